"""RL scenarios (2 gloo ranks): GRPO sync parity, update direction and iterations end to end; DAPO's
loss reduction through megatron, dynamic sampling on real rollouts, iterations end to end."""
from __future__ import annotations

import dataclasses
from functools import partial

import torch

from mfsdp_kit.train import data
from mfsdp_kit.weights import sync
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.models.hf import load
from mfsdp_kit.rl import core, dapo, grpo, loop
from mfsdp_kit.rl.rollout import HFRollout, RolloutBackend
from mfsdp_kit.train import fit, forward_backward
from scenarios_train import tiny_world


def _sft_start(workdir: str):
    """The tiny model after a short SFT on 1-digit addition, so rewards are not all zero."""
    cfg, src, tok = tiny_world(fsdp=True, workdir=workdir)
    model = load(src, cfg)
    task = data.ArithmeticTask(digits=1)
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=3e-3, warmup_steps=5), cfg)
    fit(model.chunks, opt, data.batches(task.train_pairs(90), tok, seq_len_tokens=16, global_batch=32),
        steps=40, micro_batch_size=16, progress=False)
    return cfg, src, tok, model, task


def _shards(chunks) -> list[torch.Tensor]:
    """Copies of this rank's weight shards (the sharded view the optimizer steps)."""
    engine.synchronize_fsdp_params(chunks)
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in chunks[0].parameters()]


def grpo_end_to_end(*, workdir: str, iterations: int = 3) -> dict:
    import transformers
    cfg, src, tok, model, task = _sft_start(workdir)
    result = {}

    # sync: rollout weights == Megatron export, rollout logits == Megatron logits
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    rollout = grpo.Rollout(hf, tok)
    stats = rollout.refresh(model.chunks, model.bridge)
    exported = dict(sync.export_hf_weights(model.chunks, model.bridge))
    state = hf.state_dict()
    result["sync_tensors"] = stats["tensors"]
    result["weights_maxdiff"] = max((state[k] - exported[k]).abs().max().item() for k in exported)
    tokens = torch.randint(6, 20, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for c in model.chunks:
            c.eval()
        mlogits = model.chunks[0](tokens, torch.arange(12).expand(2, 12), None)[..., :128]
        for c in model.chunks:
            c.train()
        result["logits_maxdiff"] = (hf.eval()(tokens).logits - mlogits).abs().max().item()

    # update direction: positive advantage on every sample raises their log-probs
    prompts = task.rl_prompts(8)
    comps = rollout.sample([p for p, _ in prompts], n=2, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=3)
    ids = tok([p for p, _ in prompts], add_special_tokens=False)["input_ids"]
    batch = grpo.rollout_batch([ids[i // 2] for i in range(16)], comps, torch.ones(16), seq_len_tokens=16,
                               pad_id=tok.pad_token_id)
    before = grpo.token_logprobs(model.chunks, batch, micro_batch_size=8)
    batch.extras["old_logprobs"] = before
    batch.extras["ref_logprobs"] = before.clone()
    opt_rl = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-3), cfg)
    from mfsdp_kit.train import step
    first = step(model.chunks, opt_rl, batch, micro_batch_size=8,
                 loss_fn=partial(grpo.grpo_loss, clip_eps=0.2, kl_coef=0.0))
    result["first_step_clip_frac"] = first.metrics["clip_frac"]  # ratio == 1 before any update
    result["first_step_kl"] = first.metrics["kl"]
    after = grpo.token_logprobs(model.chunks, batch, micro_batch_size=8)
    mask = batch.loss_mask
    both = torch.stack([(before * mask).sum(), (after * mask).sum()])

    result["logp_sum_before_after"] = both.tolist()  # token_logprobs covers all rows on every rank

    result["on_policy"] = _on_policy_vs_recompute(cfg, model, rollout, tok, task)

    # a few iterations end to end, with a frozen reference model and KL
    sft_dir = f"{workdir}/sft_hf"
    sync.save_hf(model.chunks, model.bridge, sft_dir)  # the reference: the policy GRPO starts from
    ref = load(sft_dir, cfg, wrap=False).chunks
    gcfg = grpo.GRPOConfig(prompts_per_iteration=8, samples_per_prompt=4, max_new_tokens=4, kl_coef=0.05,
                           ppo_epochs=2, num_minibatches=2, micro_batch_size=8)
    history = grpo.fit(chunks=model.chunks, optimizer=opt_rl, bridge=model.bridge, rollout=rollout,
                       prompt_pool=task.rl_prompts(80), reward_fn=data.verify, gcfg=gcfg, iterations=iterations,
                       seq_len_tokens=16, ref_chunks=ref, progress=False)
    result["history"] = {k: v for k, v in vars(history).items()}
    # one more iteration through the kit's own decode loop over the same HF model (refreshed in place)
    from mfsdp_kit.rl.rollout import ContinuousRollout
    hot = dataclasses.replace(gcfg, temperature=0.7,   # scored at T 0.7 on both sides (rl.scoring)
                              ppo_epochs=1, num_minibatches=1,   # one step: pi_old from its forward (rl.on_policy)
                              rollout_correction="token-mask",   # weights ~1 in fp32: the plumbing, end to end
                              advantage_estimator="rloo")
    history = grpo.fit(chunks=model.chunks, optimizer=opt_rl, bridge=model.bridge, rollout=ContinuousRollout(hf, tok),
                       prompt_pool=task.rl_prompts(80), reward_fn=data.verify, gcfg=hot, iterations=1,
                       seq_len_tokens=16, ref_chunks=ref, progress=False)
    result["continuous_history"] = {k: v for k, v in vars(history).items()}
    runtime.shutdown()
    return result


def _on_policy_vs_recompute(cfg, model, rollout, tok, task) -> dict:
    """One policy update with pi_old from its own forward (`rl.on_policy`) and one with a separate pass first,
    from the same weights (lr 1e-30 moves none) on the same rollouts, whose log-probs are planted 0.05 off at every other token so
    token-mask's [0.97, 1.03] drops some tokens: step, metrics and diagnostics per path, and the forwards run."""
    kept = core.collect(chunks=model.chunks, bridge=model.bridge, backend=rollout, prompts=task.rl_prompts(8),
                        reward=core.as_reward(data.verify), samples_per_prompt=4, max_new_tokens=4, temperature=0.7,
                        top_p=1.0, seed=5)
    kept.logprobs = [[lp + 0.05 * ((i + j) % 2) for j, lp in enumerate(row)] for i, row in enumerate(kept.logprobs)]
    still = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-30), cfg)
    forwards = [0]
    hook = model.chunks[0].register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    out = {}
    for recompute in (False, True):
        forwards[0] = 0
        gcfg = grpo.GRPOConfig(prompts_per_iteration=8, samples_per_prompt=4, max_new_tokens=4, temperature=0.7,
                               micro_batch_size=4, rollout_correction="token-mask", correction_low=0.97,
                               correction_high=1.03, recompute_old_logprobs=recompute)
        m = loop.policy_update(kept, chunks=model.chunks, optimizer=still, cfg=gcfg, seq_len_tokens=16,
                               pad_id=tok.pad_token_id, loss_fn=partial(grpo.grpo_loss, clip_eps=0.2, kl_coef=0.0))
        out["recompute" if recompute else "in_loss"] = dict(
            {k: v for k, v in m.items() if not k.endswith("_s")}, forwards=forwards[0])
    hook.remove()
    return out


def dapo_end_to_end(*, workdir: str, iterations: int = 2) -> dict:
    import transformers
    cfg, src, tok, model, task = _sft_start(workdir)
    rollout = HFRollout(transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), tok)
    assert isinstance(rollout, RolloutBackend)
    exact = core.Reward(fn=data.verify, solved_threshold=1.0)
    draw = core.PromptDraw(task.rl_prompts(80), seed=0)
    sampling = dict(samples_per_prompt=4, max_new_tokens=4, temperature=1.0, top_p=1.0)
    result = {}

    # dynamic sampling on real rollouts: 8 groups wanted, flat ones dropped, refilled in rounds
    asked, first = [], {}

    def sample_round(r, k):
        asked.append(k)
        batch = core.collect(chunks=model.chunks, bridge=model.bridge, backend=rollout, prompts=draw(k),
                             reward=data.verify, seed=core.rollout_seed(seed=0, iteration=0, round=r), refresh=r == 0,
                             **sampling)
        first.setdefault("informative", len(dapo.informative_groups(batch.rewards, group_size=4)))
        return batch
    kept, sampled, _ = dapo.dynamic_sample(sample_round=sample_round, wanted_groups=8, max_rounds=4, multiple_of=2)
    result["dynamic_sample"] = dict(asked=asked, sampled_groups=sampled.num_groups, kept_groups=kept.num_groups,
                                    informative_in_round_0=first["informative"],
                                    kept_group_std=kept.rewards.view(-1, 4).std(dim=1).tolist())

    # megatron's reduction over 2 ranks x 2 micro-batches == the one-process formula (ratio 1: l = -A)
    batch = core.training_batch(sampled, core.group_advantages(sampled.rewards, group_size=4), chunks=model.chunks,
                                ref_chunks=None, seq_len_tokens=16, pad_id=tok.pad_token_id, micro_batch_size=4)
    batch = batch.slice(0, batch.num_sequences - batch.num_sequences % 16)
    adv, lengths = batch.extras["advantages"], batch.loss_mask.sum(dim=1)
    by_hand = {"token": (-(adv * lengths).sum() / lengths.sum()).item(), "sequence": (-adv.mean()).item()}
    for level in ("token", "sequence"):
        fn = partial(grpo.policy_loss, eps_low=0.2, eps_high=0.28, kl_coef=0.0, level=level)
        mean, _, _ = forward_backward(model.chunks, batch, micro_batch_size=4, forward_only=True, loss_fn=fn)
        result[f"{level}_level"] = [mean, by_hand[level]]

    # iterations end to end
    before = _shards(model.chunks)
    dcfg = dapo.DAPOConfig(prompts_per_iteration=8, max_sampling_rounds=4, num_minibatches=1, micro_batch_size=4,
                           **{k: v for k, v in sampling.items() if k != "samples_per_prompt"})
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-3), cfg)
    history = dapo.fit(chunks=model.chunks, optimizer=opt, bridge=model.bridge, rollout=rollout,
                       prompt_pool=task.rl_prompts(80), reward_fn=exact, dcfg=dcfg, iterations=iterations,
                       seq_len_tokens=16, progress=False)
    result["weights_changed"] = any(not torch.equal(a, b) for a, b in zip(before, _shards(model.chunks)))
    result["history"] = {k: v for k, v in vars(history).items()}
    runtime.shutdown()
    return result


def refuses_pipeline_parallel() -> dict:
    """core.collect under PP 2: a ConfigError naming the field, before the backend is touched (it is None)."""
    from mfsdp_kit.config import ConfigError
    runtime.init(EngineConfig(pipeline_model_parallel_size=2))
    try:
        core.collect(chunks=None, bridge=None, backend=None, prompts=[("1+1=", "2")] * 2, reward=lambda p, c: 0.0,
                     samples_per_prompt=2, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=0)
    except ConfigError as e:
        return dict(error=str(e))
    finally:
        runtime.shutdown()
    return dict(error=None)


def grpo_tensor_parallel(*, workdir: str) -> dict:
    """TP 2 (one replica of two ranks): the kit's engine samples the same rows on both ranks (same seed), the
    placement gathers over the data-parallel group of one, and the mismatch at T 0.7 is fp32 roundoff (the logits
    scaled on their vocab-parallel shards)."""
    import transformers

    from mfsdp_kit.rl.rollout import ContinuousRollout, DecodeConfig
    cfg = EngineConfig(use_megatron_fsdp=True, tensor_model_parallel_size=2, seed=0)
    rt = runtime.init(cfg)
    src = f"{workdir}/tiny_xs_tp"
    if rt.rank == 0:
        from mfsdp_kit.models.tiny import tiny
        tiny(src, size="xs", seed=0)
    torch.distributed.barrier()
    tok = transformers.AutoTokenizer.from_pretrained(src)
    model = load(src, cfg)
    # the peers' own row counts differ (8 sequences fit rank 0's rows, 3 fit rank 1's): they must agree on 3
    rollout = ContinuousRollout(transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), tok,
                                config=DecodeConfig(max_batch_size=3 if rt.rank else 512))
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-3), cfg)
    gcfg = grpo.GRPOConfig(prompts_per_iteration=4, samples_per_prompt=2, max_new_tokens=4, temperature=0.7,
                           micro_batch_size=4)
    pool = data.ArithmeticTask(digits=1).rl_prompts(20)
    batch = core.collect(chunks=model.chunks, bridge=model.bridge, backend=rollout, prompts=pool[:4],
                         reward=data.verify, samples_per_prompt=2, max_new_tokens=4, temperature=0.7, top_p=1.0,
                         seed=5)
    history = grpo.fit(chunks=model.chunks, optimizer=opt, bridge=model.bridge, rollout=rollout, prompt_pool=pool,
                       reward_fn=data.verify, gcfg=gcfg, iterations=1, progress=False)
    per_rank = [None] * 2
    torch.distributed.all_gather_object(per_rank, (batch.completions, history.logprob_diff_max[0],
                                                   rollout.stats["rows"]))
    runtime.shutdown()
    return dict(completions=[c for c, _, _ in per_rank], diff_max=[d for _, d, _ in per_rank],
                rows=[r for _, _, r in per_rank])


def grpo_command(*, src: str, data: str, out: str) -> dict:
    """`python -m mfsdp_kit.rl.cli` on 2 ranks: the tiny folder, GSM8K-format problems, 2 iterations."""
    from mfsdp_kit.rl import cli
    history = cli.main(["--model", src, "--data", data, "--reward", "gsm8k", "--iterations", "2", "--prompts", "4",
                        "--samples", "2", "--max-new-tokens", "4", "--micro-batch-size", "4", "--lr", "1e-4",
                        "--out", out])
    return dict(history=history)
