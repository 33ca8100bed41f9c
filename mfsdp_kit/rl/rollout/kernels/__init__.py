"""The rollout engine's device kernels: what a decode step runs between and after the model's GEMMs.

    attention     decode attention in two Triton kernels (each row reads its own keys; flash-decoding's split)
    elementwise   RoPE + the cache write, residual add + RMSNorm, SiLU(gate) * up, in three Triton kernels
    sampling      the draw and its log-prob on the device in torch ops (`pick`), and `Sampler`, one call's draws
    draw          the same draw at top_p 1 in one Triton kernel (`DecodeConfig.sampler="triton"`)

Each kernel has its torch twin (`decoder.rope_store`, `add_rms`, `gated`, SDPA in `decoder.decode`, `sampling.pick`),
which is the reference its tests compare against and what runs off a GPU. A new kernel goes here, as one module with
its twin named in its docstring and a test in tests/rl/rollout/kernels/ against that twin; `decoder.Glue` (the decode
step's glue) or `sampling.Sampler` (the draw) picks it. Nothing here holds state across calls: that is
`model_runner.ModelRunner`'s. Triton is imported by these modules only, so it loads only for the engines that use it.
"""
from __future__ import annotations

import warnings

from ....config.flat import REMOVED_IN


def moved(name: str) -> None:
    """Warn (once per process: a module runs once) that `mfsdp_kit.rl.rollout.<name>` is now
    `mfsdp_kit.rl.rollout.kernels.<name>`; the old module path imports until mfsdp_kit `REMOVED_IN`."""
    warnings.warn(f"mfsdp_kit.rl.rollout.{name} is deprecated: import mfsdp_kit.rl.rollout.kernels.{name} instead; "
                  f"the old path is removed in mfsdp_kit {REMOVED_IN}", DeprecationWarning, stacklevel=2)
