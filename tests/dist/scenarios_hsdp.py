"""HSDP scenarios beyond those shared with plain layouts (run by launch.run under torchrun, 4 ranks)."""
from __future__ import annotations

from pathlib import Path

import torch

from mfsdp_kit import checkpoint as ckpt
from mfsdp_kit import runtime
from mfsdp_kit.config import EngineConfig
from scenarios_ckpt import SAVE_AT, _build, _train, _batches, full_weights  # noqa: E402  (tests/dist is on the path)


def load_into_other_layouts(*, root: str) -> dict:
    """An HSDP checkpoint (scenarios_ckpt.train_save's step 5) loaded into Megatron-FSDP over all ranks (optimizer
    included: it trains on from there) and into DDP (weights only: the kit refuses an optimizer state saved by
    another wrapper): the full weights are those saved, bit for bit."""
    out = {}
    for wrapper in ("fsdp", "ddp"):
        cfg = EngineConfig(use_megatron_fsdp=wrapper == "fsdp", seed=7)
        runtime.init(cfg)
        chunks, opt, sched = _build(cfg, 99)
        fsdp = wrapper == "fsdp"
        ckpt.CheckpointManager(root).load(chunks, opt if fsdp else None, sched if fsdp else None, step=SAVE_AT)
        ref = torch.load(Path(root) / f"full_step{SAVE_AT}.pt", map_location="cpu")
        got = {k: v.cpu() for k, v in full_weights(chunks).items()}
        out[wrapper] = dict(equal=sorted(ref) == sorted(got) and all(torch.equal(ref[k], got[k]) for k in ref),
                            n=len(ref), losses=fsdp and _train(chunks, opt, sched, _batches(), SAVE_AT, SAVE_AT + 2))
        runtime.shutdown()
    return out
