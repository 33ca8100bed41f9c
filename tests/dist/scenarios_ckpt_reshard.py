"""Resuming at another data-parallel size (issue 51): Megatron-FSDP's optimizer state reshards, DDP's is refused.

`straight`: 1 rank trains STEPS steps of the tiny GPT (fp32, one global batch of GLOBAL_BATCH rows whatever the
world size), saving at step 2. `leg(load_step, save_step, stop)`: a fresh build (another seed) on this many ranks
loads `load_step` with its optimizer, trains until `stop` and saves `save_step`. 1 -> 2 -> 1 is
straight(save 2), leg(2 -> 4) on 2 ranks, leg(4 -> 6) on 1 rank; the losses must equal the straight run's.
`ddp_refused`: a 1-rank DDP checkpoint's optimizer at 2 ranks is refused by name; its model weights load.
"""
from __future__ import annotations

from mfsdp_kit import checkpoint as ckpt
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.models import gpt_model_fn
from mfsdp_kit.train import step
from scenarios import SPEC, random_batches  # noqa: E402  (tests/dist is on the path)

STEPS, GLOBAL_BATCH, MICRO = 6, 4, 2
OCFG = OptimConfig(lr=3e-3, warmup_steps=2, decay_steps=20, min_lr=1e-4)


def _build(fsdp: bool, seed: int):
    cfg = EngineConfig(use_megatron_fsdp=fsdp, seed=7)
    runtime.init(cfg)
    runtime.set_seed(seed)
    chunks = engine.build(cfg, gpt_model_fn(SPEC, cfg))
    opt = engine.build_optimizer(chunks, OCFG, cfg)
    return chunks, opt, engine.build_scheduler(opt, OCFG)


def _train(chunks, opt, sched, start: int, stop: int) -> list[float]:
    batches = random_batches(steps=STEPS, batch=GLOBAL_BATCH, seq=SPEC.seq_len_tokens, vocab=SPEC.vocab_size, seed=4)
    return [step(chunks, opt, batches[i], micro_batch_size=MICRO, scheduler=sched, step_index=i).loss
            for i in range(start, stop)]


def straight(*, root: str, fsdp: bool = True, save_at: int = 2) -> dict:
    chunks, opt, sched = _build(fsdp, 7)
    mgr = ckpt.CheckpointManager(root)
    losses = _train(chunks, opt, sched, 0, save_at)
    mgr.save(save_at, chunks, opt, sched, extra={"data_position": save_at})
    engine.restore_fsdp_params(chunks)
    losses += _train(chunks, opt, sched, save_at, STEPS)
    runtime.shutdown()
    return dict(losses=losses)


def leg(*, root: str, load_step: int, save_step: int, stop: int) -> dict:
    chunks, opt, sched = _build(True, 1234)
    mgr = ckpt.CheckpointManager(root)
    info = mgr.load(chunks, opt, sched, step=load_step)
    losses = _train(chunks, opt, sched, load_step, save_step)
    mgr.save(save_step, chunks, opt, sched, extra={"data_position": save_step})
    engine.restore_fsdp_params(chunks)
    losses += _train(chunks, opt, sched, save_step, stop)
    runtime.shutdown()
    return dict(losses=losses, step=info["step"], saved_world=info["world_size"], restored=info["restored"])


def ddp_refused(*, root: str) -> dict:
    """A 1-rank DDP checkpoint at 2 ranks: the optimizer refused by name, the model weights alone load."""
    chunks, opt, sched = _build(False, 1234)
    mgr = ckpt.CheckpointManager(root)
    try:
        mgr.load(chunks, opt, sched, step=2)
        refusal = None
    except ckpt.CheckpointError as e:
        refusal = str(e)
    info = mgr.load(chunks, step=2)
    runtime.shutdown()
    return dict(refusal=refusal, weights_only=info["restored"])
