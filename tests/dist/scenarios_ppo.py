"""PPO scenario (2 gloo ranks): the value model as Megatron-FSDP shards it, PPO iterations end to end, and the
critic's optimizer stepping nothing of the policy's."""
from __future__ import annotations

import dataclasses

import torch

from mfsdp_kit.train import data, packing
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import OptimConfig
from mfsdp_kit.distributed.introspect import inner_optimizers
from mfsdp_kit.models.hf import load
from mfsdp_kit.rl import core, critic, ppo
from mfsdp_kit.rl.rollout import HFRollout
from scenarios_rl import _sft_start, _shards


def _sharding(value, rollouts, tok) -> dict:
    """How Megatron-FSDP holds the value model, and the shape of its values."""
    engine.synchronize_fsdp_params(value)
    named = dict(value[0].named_parameters())
    head = {n: p for n, p in named.items() if "output_layer" in n}
    per_rank = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(per_rank, engine.local_numel(value))
    batch = critic.value_batch(rollouts, seq_len_tokens=16, pad_id=tok.pad_token_id)
    v = critic.values(value, batch, micro_batch_size=8)
    return dict(wrapper=type(value[0]).__name__, hidden_size=engine.unwrap_model(value[0]).config.hidden_size,
                head_shape=[list(p.shape) for n, p in head.items() if n.endswith("weight")][0],
                vocab_head_gone=all(p.shape[0] == 1 for p in head.values()),
                all_dtensors=all(hasattr(p, "to_local") for p in named.values()),
                local_numel=per_rank, global_numel=engine.global_numel(value), values_shape=list(v.shape))


def _packed_vs_padded(value, rollouts, tok) -> dict:
    """The trained critic's values from packed rows against padded ones (max |diff|), and whether it packs."""
    batch = critic.value_batch(rollouts, seq_len_tokens=16, pad_id=tok.pad_token_id)
    packed, padded = (critic.values(value, batch, micro_batch_size=8, packed=p) for p in (True, False))
    return dict(can_pack=packing.can_pack(value), max_diff=(packed - padded).abs().max().item(),
                values_abs_mean=padded[batch.loss_mask != 0].abs().mean().item())


def _checkpoint_round_trip(value, critic_opt, build, rollouts, tok, root: str) -> dict:
    """Save the trained critic (`checkpoint.CheckpointManager`, model and optimizer) and load it into a fresh
    build (`build()`: its zero head gives V = 0 until the load): the fresh critic's values are the saved ones."""
    from mfsdp_kit import checkpoint
    batch = critic.value_batch(rollouts, seq_len_tokens=16, pad_id=tok.pad_token_id)
    saved = critic.values(value, batch, micro_batch_size=8)
    manager = checkpoint.CheckpointManager(root)
    manager.save(1, value, critic_opt)
    fresh, fresh_opt = build()
    manager.load(fresh, fresh_opt)
    after = critic.values(fresh, batch, micro_batch_size=8)
    return dict(saved_abs_max=saved.abs().max().item(), after=(after - saved).abs().max().item())


def _adam_steps(optimizer) -> float:
    """Adam's step counts summed over the parameters this rank's optimizer holds state for."""
    adams = [opt.optimizer for opt in inner_optimizers(optimizer) if getattr(opt, "optimizer", None) is not None]
    return float(sum(float(s["step"]) for adam in adams for s in adam.state.values() if "step" in s))


def _separate(model, policy_opt, value, critic_opt, rollouts, tok) -> dict:
    """One critic step moves the critic and its optimizer, nothing of the policy's."""
    ids = lambda opt: {id(p) for g in opt.param_groups for p in g["params"]}  # noqa: E731
    batch = critic.value_batch(rollouts, seq_len_tokens=16, pad_id=tok.pad_token_id)
    v = critic.values(value, batch, micro_batch_size=8)
    batch.extras.update(values=v, returns=v + 1.0)
    policy_before, critic_before, steps = _shards(model.chunks), _shards(value), _adam_steps(policy_opt)
    critic_steps = _adam_steps(critic_opt)
    critic.update(chunks=value, optimizer=critic_opt, batch=batch, value_clip=0.5, epochs=1, num_minibatches=1,
                  micro_batch_size=8)
    return dict(shared_params=len(ids(policy_opt) & ids(critic_opt)), critic_params=len(ids(critic_opt)),
                policy_params=len(ids(policy_opt)),
                policy_unchanged_by_critic_step=all(torch.equal(a, b) for a, b in zip(policy_before,
                                                                                       _shards(model.chunks))),
                critic_changed=any(not torch.equal(a, b) for a, b in zip(critic_before, _shards(value))),
                policy_state_steps_before_after=[steps, _adam_steps(policy_opt)],
                critic_state_steps_before_after=[critic_steps, _adam_steps(critic_opt)])


def ppo_end_to_end(*, workdir: str, iterations: int = 6, critic_lr: float = 1e-3) -> dict:
    """The SFT'd tiny policy and a critic from the base weights, `iterations` of PPO. The reward is digit_match
    (partial credit, mean ~0.25 here): exact match scores ~0.1 on this policy, so sparsely that the value loss
    is mostly the sampling noise of the rewards and says little about the critic."""
    import transformers
    cfg, src, tok, model, task = _sft_start(workdir)
    rollout = HFRollout(transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), tok)
    # the base model's trunk and a zero head; SDPA attention, so the critic's forwards and steps run packed rows
    # (`packing`) while the policy's (megatron's local attention) run padded ones
    ccfg = dataclasses.replace(cfg, kernels=dataclasses.replace(cfg.kernels, attention_backend="sdpa"))

    def build():
        value = critic.value_model(load(src, ccfg, wrap=False).chunks, ccfg)
        return value, engine.build_optimizer(value, OptimConfig(lr=critic_lr), ccfg)
    value, critic_opt = build()
    rollouts = core.collect(chunks=model.chunks, bridge=model.bridge, backend=rollout, prompts=task.rl_prompts(4),
                            reward=data.verify, samples_per_prompt=4, max_new_tokens=4, temperature=1.0, top_p=1.0,
                            seed=0)
    result = dict(sharding=_sharding(value, rollouts, tok))

    policy_opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-3), cfg)
    pcfg = ppo.PPOConfig(prompts_per_iteration=8, samples_per_prompt=4, max_new_tokens=4, ppo_epochs=2,
                         num_minibatches=2, micro_batch_size=8)
    before = _shards(model.chunks)
    history = ppo.fit(chunks=model.chunks, optimizer=policy_opt, critic_chunks=value, critic_optimizer=critic_opt,
                      bridge=model.bridge, rollout=rollout, prompt_pool=task.rl_prompts(80), reward_fn=data.digit_match,
                      pcfg=pcfg, iterations=iterations, seq_len_tokens=16, progress=False)
    result["policy_weights_changed"] = any(not torch.equal(a, b) for a, b in zip(before, _shards(model.chunks)))
    result["history"] = {k: v for k, v in vars(history).items()}
    result["packed_vs_padded_values"] = _packed_vs_padded(value, rollouts, tok)
    # one optimizer step per iteration: pi_old from the update's own forward (rl.on_policy), per-token advantages
    one_step = dataclasses.replace(pcfg, ppo_epochs=1, num_minibatches=1)
    history = ppo.fit(chunks=model.chunks, optimizer=policy_opt, critic_chunks=value, critic_optimizer=critic_opt,
                      bridge=model.bridge, rollout=rollout, prompt_pool=task.rl_prompts(80), reward_fn=data.digit_match,
                      pcfg=one_step, iterations=1, seq_len_tokens=16, progress=False)
    result["one_step_history"] = {k: v for k, v in vars(history).items()}
    result["checkpoint"] = _checkpoint_round_trip(value, critic_opt, build, rollouts, tok,
                                                  f"{workdir}/critic_ckpt")
    result["separate"] = _separate(model, policy_opt, value, critic_opt, rollouts, tok)
    runtime.shutdown()
    return result
