"""GRPO scenarios: sync parity, update direction, a few iterations end to end (2 gloo ranks)."""
from __future__ import annotations

import torch

from mfsdp_kit import data, engine, runtime, sync
from mfsdp_kit.config import OptimConfig
from mfsdp_kit.models.hf import load
from mfsdp_kit.rl import grpo
from mfsdp_kit.train import fit
from scenarios_train import tiny_world


def grpo_end_to_end(*, workdir: str, iterations: int = 3) -> dict:
    import transformers
    cfg, src, tok = tiny_world(fsdp=True, workdir=workdir)
    model = load(src, cfg)
    task = data.ArithmeticTask(digits=1)
    ocfg = OptimConfig(lr=3e-3, warmup_steps=5)
    opt = engine.build_optimizer(model.chunks, ocfg, cfg)
    fit(model.chunks, opt, data.batches(task.train_pairs(90), tok, seq_len_tokens=16, global_batch=32),
        steps=40, micro_batch_size=16, progress=False)  # a short SFT so rewards are not all zero
    result = {}

    # sync: rollout weights == Megatron export, rollout logits == Megatron logits
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
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
    from functools import partial
    from mfsdp_kit.train import step
    first = step(model.chunks, opt_rl, batch, micro_batch_size=8,
                 loss_fn=partial(grpo.grpo_loss, clip_eps=0.2, kl_coef=0.0))
    result["first_step_clip_frac"] = first.metrics["clip_frac"]  # ratio == 1 before any update
    result["first_step_kl"] = first.metrics["kl"]
    after = grpo.token_logprobs(model.chunks, batch, micro_batch_size=8)
    mask = batch.loss_mask
    both = torch.stack([(before * mask).sum(), (after * mask).sum()])

    result["logp_sum_before_after"] = both.tolist()  # token_logprobs covers all rows on every rank

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
    runtime.shutdown()
    return result
