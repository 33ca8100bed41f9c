"""Packed vs padded on real gloo ranks: the same model, seed and skewed-length batches, trained and scored
both ways (each run inits and shuts down its own layout, seeded alike, as scenarios.train_losses does)."""
from __future__ import annotations

import torch

from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.models import GPTSpec, gpt_model_fn
from mfsdp_kit.perf import length_mix
from mfsdp_kit.rl import core
from mfsdp_kit.train import forward_backward, step

SPEC = GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=128,
               seq_len_tokens=48)


def skewed_batches(*, steps: int, global_batch: int, seed: int = 0) -> list:
    """`steps` batches whose lengths span 3..48 tokens (most short, a few full), loss on each reply."""
    out = []
    for s in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + s)
        total = torch.where(torch.rand(global_batch, generator=g) < 0.25, SPEC.seq_len_tokens,
                            torch.randint(3, 16, (global_batch,), generator=g)).tolist()
        pairs = [(int(torch.randint(1, t - 1, (1,), generator=g)), t) for t in total]
        out.append(length_mix.batch(pairs, seq_len_tokens=SPEC.seq_len_tokens, vocab_size=SPEC.vocab_size,
                                    seed=seed * 1000 + s))
    return out


def _model(*, fsdp: bool, tp: int, ddp: dict | None = None):
    cfg = EngineConfig(use_megatron_fsdp=fsdp, tensor_model_parallel_size=tp, seed=7, attention_backend="sdpa",
                       override_ddp_config=ddp or {})
    runtime.init(cfg)
    chunks = engine.build(cfg, gpt_model_fn(SPEC, cfg))
    return cfg, chunks


def train_run(*, fsdp: bool, tp: int = 1, packed: bool, steps: int = 3, micro_batch_size: int = 2,
              max_tokens_per_micro_batch: int | None = None, global_batch: int = 8) -> dict:
    """`steps` optimizer steps, then the per-token log-probs of the first batch (`rl.core.token_logprobs`)."""
    cfg, chunks = _model(fsdp=fsdp, tp=tp)
    opt = engine.build_optimizer(chunks, OptimConfig(lr=3e-3), cfg)
    pool = skewed_batches(steps=2, global_batch=global_batch)
    how = dict(micro_batch_size=micro_batch_size, max_tokens_per_micro_batch=max_tokens_per_micro_batch,
               packed=packed)
    results = [step(chunks, opt, pool[i % 2], step_index=i, **how) for i in range(steps)]
    logp = core.token_logprobs(chunks, pool[0], **how) * pool[0].loss_mask
    runtime.shutdown()
    return dict(losses=[r.loss for r in results], grad_norms=[r.grad_norm for r in results],
                tokens=[r.tokens for r in results], logprobs=logp.tolist())


def first_grads(*, packed: bool, micro_batch_size: int = 2, max_tokens_per_micro_batch: int | None = None,
                global_batch: int = 8) -> dict:
    """The gradient of one skewed global batch, all-reduced (DDP without the distributed optimizer, whose
    reduce-scatter leaves each rank only its shard reduced: the rest is that rank's own partial sum)."""
    cfg, chunks = _model(fsdp=False, tp=1, ddp=dict(use_distributed_optimizer=False))
    batch = skewed_batches(steps=1, global_batch=global_batch, seed=3)[0]
    for c in chunks:
        c.zero_grad_buffer()
    loss, tokens, _ = forward_backward(chunks, batch, micro_batch_size=micro_batch_size, packed=packed,
                                       max_tokens_per_micro_batch=max_tokens_per_micro_batch)
    grads = torch.cat([b.grad_data.flatten().float() for c in chunks for b in c.buffers])
    runtime.shutdown()
    return dict(loss=loss, tokens=tokens, grads=grads.tolist())


def rl_update(*, packed: bool, fsdp: bool = True, level: str = "sequence") -> dict:
    """`rl.core.update` with GRPO's loss (per-sequence advantages, KL to a reference, `level`) over two
    minibatches and two epochs of a skewed batch whose old log-probs come from `token_logprobs`."""
    from functools import partial
    from mfsdp_kit.rl import grpo
    cfg, chunks = _model(fsdp=fsdp, tp=1)
    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-2), cfg)
    batch = skewed_batches(steps=1, global_batch=16, seed=5)[0]
    batch.extras["advantages"] = torch.randn(16, generator=torch.Generator().manual_seed(0))
    batch.extras["old_logprobs"] = core.token_logprobs(chunks, batch, micro_batch_size=4, packed=packed)
    batch.extras["ref_logprobs"] = batch.extras["old_logprobs"] - 0.05 * batch.loss_mask
    results = core.update(chunks=chunks, optimizer=opt, batch=batch, epochs=2, num_minibatches=2, micro_batch_size=4,
                          packed=packed, loss_fn=partial(grpo.grpo_loss, clip_eps=0.2, kl_coef=0.1, level=level))
    runtime.shutdown()
    return dict(losses=[r.loss for r in results], grad_norms=[r.grad_norm for r in results],
                tokens=[r.tokens for r in results], metrics=[r.metrics for r in results])
