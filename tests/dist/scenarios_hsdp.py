"""HSDP scenarios beyond those shared with plain layouts (run by launch.run under torchrun, 4 ranks)."""
from __future__ import annotations

from mfsdp_kit import checkpoint as ckpt
from mfsdp_kit.distributed import runtime
from mfsdp_kit.config import EngineConfig
from scenarios_ckpt import SAVE_AT, _batches, _build, _train, weights_as_saved  # noqa: E402  (tests/dist on path)


def load_into_other_layouts(*, root: str) -> dict:
    """An HSDP checkpoint (scenarios_ckpt.train_save's step 5) loaded into Megatron-FSDP over all ranks (optimizer
    included: it trains on from there) and into DDP (weights only: the kit refuses an optimizer state saved by
    another wrapper): the full weights are those saved, bit for bit."""
    out = {}
    for fsdp in (True, False):
        cfg = EngineConfig(use_megatron_fsdp=fsdp, seed=7)
        runtime.init(cfg)
        chunks, opt, sched = _build(cfg, 99)
        ckpt.CheckpointManager(root).load(chunks, opt if fsdp else None, sched if fsdp else None, step=SAVE_AT)
        loaded = weights_as_saved(chunks, root)   # before training on
        loaded["losses"] = fsdp and _train(chunks, opt, sched, _batches(), SAVE_AT, SAVE_AT + 2)
        out["fsdp" if fsdp else "ddp"] = loaded
        runtime.shutdown()
    return out
