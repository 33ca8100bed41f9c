"""Multi-rank scenarios (run by launch.run under torchrun). Each returns rank 0's findings."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.train.data import random_token_batches
from mfsdp_kit.models import GPTSpec, gpt_model_fn
from mfsdp_kit.train import Batch, forward_backward, step

SPEC = GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=128,
               seq_len_tokens=16)


def random_batches(*, steps: int, batch: int, seq: int, vocab: int, seed: int = 0) -> list[Batch]:
    """Random tokens with 20 % of positions out of the loss (uneven token counts per rank)."""
    return random_token_batches(steps=steps, global_batch=batch, seq_len_tokens=seq, vocab_size=vocab, seed=seed,
                                masked_fraction=0.2)


def train_losses(*, fsdp: bool, steps: int = 5, tp: int = 1, micro_batch_size: int = 2,
                 global_batch: int = 8, ddp: dict | None = None) -> dict:
    cfg = EngineConfig(use_megatron_fsdp=fsdp, tensor_model_parallel_size=tp, seed=7, override_ddp_config=ddp or {})
    rt = runtime.init(cfg)
    chunks = engine.build(cfg, gpt_model_fn(SPEC, cfg))
    opt = engine.build_optimizer(chunks, OptimConfig(lr=3e-3), cfg)
    local = torch.tensor([engine.local_numel(chunks)])
    per_rank = [torch.zeros(1, dtype=torch.long) for _ in range(rt.world_size)]
    dist.all_gather(per_rank, local)
    losses, norms = [], []
    pool = random_batches(steps=2, batch=global_batch, seq=SPEC.seq_len_tokens, vocab=SPEC.vocab_size)
    for i in range(steps):  # two batches in turn: parity on different data, and the loss can fall
        b = pool[i % 2]
        r = step(chunks, opt, b, micro_batch_size=micro_batch_size, step_index=i)
        losses.append(r.loss)
        norms.append(r.grad_norm)
    from mfsdp_kit.distributed.memory import memory_report
    result = dict(losses=losses, grad_norms=norms, local_numel=[int(t) for t in per_rank],
                  memory=memory_report(chunks, opt).as_dict(),
                  global_numel=engine.global_numel(chunks), spec_params=SPEC.param_count(),
                  wrapper=type(chunks[0]).__name__)
    runtime.shutdown()
    return result


def sync_two_chunks(*, first_only: bool = False) -> dict:
    """Two FSDP chunks: after a step, sync must turn BOTH chunks' params into current DTensor shards."""
    from torch.distributed.tensor import DTensor
    cfg = EngineConfig(use_megatron_fsdp=True)
    runtime.init(cfg)
    fn = gpt_model_fn(SPEC, cfg)
    chunks = [engine.wrap_chunk(cfg, engine.build(cfg, fn, wrap=False)[0], index=i) for i in range(2)]
    engine.attach_schedule_hooks(chunks[:1])
    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-2), cfg)
    b = random_batches(steps=1, batch=4, seq=SPEC.seq_len_tokens, vocab=SPEC.vocab_size)[0]
    step(chunks[:1], opt, b, micro_batch_size=2)
    for c in chunks:  # a forward leaves the unsharded compute params installed
        with torch.no_grad():
            c(b.tokens[:2], torch.arange(16).expand(2, 16), None)
    synced = engine.synchronize_fsdp_params(chunks[:1] if first_only else chunks)
    dtensor_chunks = [all(isinstance(p, DTensor) for p in c.parameters()) for c in chunks]
    restored = engine.restore_fsdp_params(chunks)
    raw_after_restore = [not any(isinstance(p, DTensor) for p in c.parameters()) for c in chunks]
    runtime.shutdown()
    return dict(synced=synced, dtensor_chunks=dtensor_chunks, restored=restored,
                raw_after_restore=raw_after_restore)


def sync_after_a_prefetching_forward() -> dict:
    """A forward leaves the next unit's all-gather prefetched. The kit's sharded view (sync, checkpoints, a
    profile's end) waits for it quietly; megatron's own synchronize_param_gather warns that it found it (the
    control: the same state, the same wait)."""
    import warnings
    from mfsdp_kit.distributed.introspect import all_gather_pipelines
    cfg = EngineConfig(use_megatron_fsdp=True)
    runtime.init(cfg)
    chunks = engine.build(cfg, gpt_model_fn(dataclasses.replace(SPEC, num_layers=4), cfg))
    b = random_batches(steps=1, batch=4, seq=SPEC.seq_len_tokens, vocab=SPEC.vocab_size)[0]
    out = {}
    for name, sync in (("kit", lambda: engine.synchronize_fsdp_params(chunks)),
                       ("megatron", lambda: chunks[0].module.synchronize_param_gather())):
        with torch.no_grad():
            chunks[0](b.tokens[:2], torch.arange(16).expand(2, 16), None)
        pending = sum(len(p.param_gather_event_map) for p in all_gather_pipelines(chunks))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            sync()
        left = sum(len(p.param_gather_event_map) for p in all_gather_pipelines(chunks))
        engine.restore_fsdp_params(chunks)
        out[name] = dict(pending=pending, left=left,
                         warned=[str(w.message)[:50] for w in seen if "pending all-gather" in str(w.message)])
    runtime.shutdown()
    return out


def sequence(*, calls: list) -> list:
    """Several scenarios one after another in this one world, as a notebook runs several cells:
    `calls` = [[scenario, kwargs], ...] -> [result, ...]. One job instead of a job per case."""
    import importlib
    results = []
    for name, kwargs in calls:
        module, _, function = name.rpartition(":")
        results.append(getattr(importlib.import_module(module or "scenarios"), function)(**kwargs))
    return results


def hf_roundtrip(*, arch: str, tp: int, fsdp: bool, workdir: str) -> dict:
    """HF -> Megatron (wrapped) -> logits parity, exact export, one step, export, save_hf, reload."""
    from mfsdp_kit.perf.roundtrip import roundtrip
    return roundtrip(arch=arch, size="xs", tp=tp, fsdp=fsdp, dtype="fp32", workdir=workdir)


def release_frees(*, release: bool, dtype: str = "fp32") -> dict:
    """Build + train an FSDP model, drop it (with or without engine.release): is it freed?"""
    import gc
    import weakref
    cfg = EngineConfig(use_megatron_fsdp=True, dtype=dtype)
    runtime.init(cfg)
    chunks = engine.build(cfg, gpt_model_fn(SPEC, cfg))
    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-2), cfg)
    b = random_batches(steps=1, batch=4, seq=SPEC.seq_len_tokens, vocab=SPEC.vocab_size)[0]
    step(chunks, opt, b, micro_batch_size=2)
    alive = weakref.ref(chunks[0].module)
    if release:
        engine.release(chunks)
    del chunks, opt
    gc.collect()
    runtime.shutdown()
    return dict(freed=alive() is None)


def pending_gathers(*, settle: bool) -> dict:
    """Megatron-FSDP all-gathers left pending (issued, not waited on) after a training step and a
    forward-only pass (CPU/gloo), with engine.settle_param_gathers as train/generate call it, or disabled."""
    if not settle:
        engine.settle_param_gathers = lambda chunks: None
    cfg = EngineConfig(use_megatron_fsdp=True)
    runtime.init(cfg)
    chunks = engine.build(cfg, gpt_model_fn(SPEC, cfg))
    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-2), cfg)
    b = random_batches(steps=1, batch=4, seq=SPEC.seq_len_tokens, vocab=SPEC.vocab_size)[0]
    pending = lambda: len(chunks[0].module.all_gather_pipeline.param_gather_event_map)  # noqa: E731
    step(chunks, opt, b, micro_batch_size=2)
    after_step = pending()
    forward_backward(chunks, b, micro_batch_size=2, forward_only=True)
    after_forward = pending()
    runtime.shutdown()
    return dict(after_step=after_step, after_forward=after_forward)


def reinit_cycles(*, cycles: int, port: int | None) -> dict:
    """init -> all-reduce (world and a megatron group) -> shutdown(destroy_process_group=True), `cycles` times
    in one process. With `port`, through the kit's own store on it, as on a notebook engine; with None,
    through torchrun's agent store. Every cycle reuses the same store address."""
    import os
    import time
    from megatron.core import parallel_state as ps
    if port is not None:
        for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"):
            os.environ.pop(name, None)
    sums, dp_sizes, seconds = [], [], []
    for _ in range(cycles):
        start = time.perf_counter()
        rt = runtime.init(EngineConfig(), master_port=port)
        x = torch.tensor([rt.rank + 1.0])
        dist.all_reduce(x)
        dist.all_reduce(x, group=ps.get_data_parallel_group())
        sums.append(x.item())
        dp_sizes.append(ps.get_data_parallel_world_size())
        runtime.shutdown(destroy_process_group=True)
        seconds.append(time.perf_counter() - start)
    return dict(sums=sums, dp_sizes=dp_sizes, seconds=seconds)


def listening_addresses() -> dict:
    """Every rank's listening TCP sockets after init and an all-reduce (gloo's included)."""
    import os
    import psutil
    rt = runtime.init(EngineConfig())
    x = torch.tensor([1.0])
    dist.all_reduce(x)
    mine = [c.laddr.ip for c in psutil.Process(os.getpid()).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]
    everyone = [None] * rt.world_size
    dist.all_gather_object(everyone, mine)
    runtime.shutdown(destroy_process_group=True)
    return dict(listening=everyone, gloo_ifname=os.environ.get("GLOO_SOCKET_IFNAME"))


def cross_entropy_vocab_parallel() -> dict:
    """TP = 2 over gloo: the same full logits on both ranks, each keeps its half of the vocabulary; the kit's
    fused cross-entropy and megatron's vocab-parallel one, losses and slice gradients, max |diff| over ranks."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from mfsdp_kit.distributed.cross_entropy import cross_entropy
    rt = runtime.init(EngineConfig(tensor_model_parallel_size=2))
    g = torch.Generator().manual_seed(3)
    full = torch.randn(9, 2, 40, generator=g) * 3
    target = torch.randint(0, 40, (9, 2), generator=g)
    weights = torch.rand(9, 2, generator=g)
    rank = ps.get_tensor_model_parallel_rank()
    results = []
    for fn in (vocab_parallel_cross_entropy,
               lambda x, t: cross_entropy(x, t, group=ps.get_tensor_model_parallel_group())):
        x = full[..., 20 * rank:20 * (rank + 1)].clone().requires_grad_()
        loss = fn(x, target)
        (loss * weights).sum().backward()
        results.append((loss.detach(), x.grad))
    diffs = torch.tensor([(results[0][0] - results[1][0]).abs().max().item(),
                          (results[0][1] - results[1][1]).abs().max().item()])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    labels = [int(((target >= 20 * r) & (target < 20 * (r + 1))).sum()) for r in range(rt.world_size)]
    runtime.shutdown()
    return dict(loss_max_diff=diffs[0].item(), grad_max_diff=diffs[1].item(), labels_per_rank=labels)


def finalize_grads_match(*, fsdp: bool) -> dict:
    """One backward, finalized once by megatron's `finalize_model_grads` and once by `engine.finalize_grads`
    with a tensor's truth value and `.item()` forbidden (no host read of the token count): max |grad diff|."""
    import contextlib
    from hostreads import no_host_reads
    from megatron.core.distributed import finalize_model_grads
    from mfsdp_kit.distributed.introspect import fsdp_buffers

    cfg = EngineConfig(use_megatron_fsdp=fsdp, seed=7)
    runtime.init(cfg)
    batch = random_batches(steps=1, batch=8, seq=SPEC.seq_len_tokens, vocab=SPEC.vocab_size)[0]
    grads, scaled = [], []
    for finalize in (finalize_model_grads, engine.finalize_grads):
        runtime.set_seed(cfg.seed)
        chunks = engine.build(cfg, gpt_model_fn(SPEC, cfg))
        captured = {}
        engine.unwrap_model(chunks[0]).config.finalize_model_grads_func = \
            lambda model, num_tokens, **kw: captured.update(model=model, num_tokens=num_tokens, kw=kw)
        forward_backward(chunks, batch, micro_batch_size=2)
        buffers = list(fsdp_buffers(chunks, "main_grad_buffer")) if fsdp else [b.grad_data for b in chunks[0].buffers]
        before = torch.cat([b.float().reshape(-1) for b in buffers]).clone()
        with no_host_reads() if finalize is engine.finalize_grads else contextlib.nullcontext():
            finalize(captured["model"], captured["num_tokens"], **captured["kw"])
        grads.append(torch.cat([b.float().reshape(-1) for b in buffers]))
        scaled.append(not torch.equal(before, grads[-1]))
        engine.release(chunks)
    result = dict(max_diff=(grads[0] - grads[1]).abs().max().item(), grad_abs_sum=grads[0].abs().sum().item(),
                  scaled=scaled, tokens=int(captured["num_tokens"]))
    runtime.shutdown()
    return result


def fail_on(*, rank: int) -> dict:
    """Rank `rank` raises; every other rank waits in a barrier it would never leave (the launcher must stop it)."""
    rt = runtime.init(EngineConfig())
    if rt.rank == rank:
        raise RuntimeError(f"planted failure on rank {rank}")
    dist.barrier()
    return {}


def pids() -> dict:
    """Every rank's process id, and whether this process ran a scenario before (a fresh one has not)."""
    import os
    global _ran_before
    ran_before, _ran_before = _ran_before, True
    rt = runtime.init(EngineConfig())
    everyone = [None] * rt.world_size
    dist.all_gather_object(everyone, os.getpid())
    runtime.shutdown()
    return dict(pids=everyone, ran_before=ran_before)


_ran_before = False


def sleep(*, seconds: float) -> dict:
    import time
    time.sleep(seconds)
    return {}
