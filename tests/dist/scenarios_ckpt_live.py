"""Checkpoint scenario (2 gloo ranks): a load into the live model, after it has trained and run forwards."""
from __future__ import annotations

from mfsdp_kit import checkpoint
from mfsdp_kit.train import data
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import OptimConfig
from mfsdp_kit.models.hf import load
from mfsdp_kit.rl import core
from mfsdp_kit.train import step
from scenarios_train import tiny_world


def load_in_place(*, workdir: str, fsdp: bool) -> dict:
    """Step, save, step, forward, load into the same chunks and optimizer: the next forward is the saved model's."""
    cfg, src, tok = tiny_world(fsdp=fsdp, workdir=workdir)
    chunks = load(src, cfg).chunks
    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-2), cfg)
    batch = next(data.batches(data.ArithmeticTask(digits=1).train_pairs(90), tok, seq_len_tokens=16, global_batch=16))
    logprobs = lambda: core.token_logprobs(chunks, batch, micro_batch_size=8)  # noqa: E731
    step(chunks, opt, batch, micro_batch_size=8)
    saved = logprobs()
    manager = checkpoint.CheckpointManager(f"{workdir}/ckpt")
    manager.save(1, chunks, opt)
    step(chunks, opt, batch, micro_batch_size=8)
    moved = logprobs()   # a forward: Megatron-FSDP leaves the next forward's all-gathers prefetched
    manager.load(chunks, opt)
    loaded = logprobs()
    step(chunks, opt, batch, micro_batch_size=8)   # and training goes on from the loaded weights
    runtime.shutdown()
    return dict(moved=(moved - saved).abs().max().item(), loaded=(loaded - saved).abs().max().item())
