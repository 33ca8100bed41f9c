"""Peak device memory per training phase, and a clean slate between two measured models.

torch keeps ONE peak counter (`torch.cuda.max_memory_allocated`). A step has two phases whose
peaks answer different questions: forward/backward (activations on top of the model state) and
the optimizer step (Adam's temporaries). `PhasePeaks` reads and resets the counter at the phase
boundaries, so each phase keeps its own maximum and `overall()` is still the whole run's.
"""
from __future__ import annotations

import gc
import traceback
from typing import Callable

import torch

from ..distributed import engine, runtime, step_pipeline
from ..compat.access import fsdp
from ..config import ConfigError, EngineConfig


class PhasePeaks:
    """Peak allocated bytes of the forward/backward phase and of the optimizer step, kept apart:
    `before_step()` ends a forward/backward, `after_step()` ends an optimizer step.
    record=False leaves torch's counter alone (a caller that reads torch's own peaks)."""

    def __init__(self, record: bool = True):
        self.record = record
        self.peaks = {"forward_backward": 0, "optimizer_step": 0}

    def close(self, phase: str) -> None:
        """End `phase`: keep the counter's maximum for it, then reset the counter."""
        if self.record and torch.cuda.is_available():
            self.peaks[phase] = max(self.peaks[phase], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    def before_step(self) -> None:
        self.close("forward_backward")

    def after_step(self) -> None:
        self.close("optimizer_step")

    def overall(self) -> int:
        current = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        return max(current, *self.peaks.values())


def record_step_phases(optimizer, peaks: PhasePeaks) -> None:
    """Make `optimizer.step()` (called inside train.step) mark the phase boundaries around itself."""
    def timed(inner, _owner):
        def step_with_phases(*a, **kw):
            peaks.before_step()
            out = inner(*a, **kw)
            peaks.after_step()
            return out
        return step_with_phases
    step_pipeline.add(optimizer, stage="phase_timing", wrap=timed)   # outermost: the reload and offload count


def free_memory() -> None:
    """Free every model built so far (call it only between models), then the allocator's cache;
    reset the peak statistics.

    A dropped Megatron-FSDP model is NOT freed by megatron-core 0.16.1 on its own, so without
    this each fsdp variant kept its memory and inflated the peaks of the variants after it:
    - RotaryEmbedding.forward is a functools.lru_cache (models/common/embeddings/
      rotary_pos_embedding.py:177) whose keys hold the module, and the state-dict hooks that
      Megatron-FSDP puts on every submodule hold the wrapper;
    - each parameter's post-accumulate-grad hook (megatron_fsdp.py, `_register_fsdp_hooks`)
      closes over the wrapper, a cycle through C++ that gc cannot collect;
    - Megatron-FSDP's module-level buffer pool (megatron_fsdp/utils.py, `_GLOBAL_MEMORY_BUFFER`,
      the fsdp_double_buffer pool; private, reset here by name).
    `engine.release` undoes the first two for every MegatronFSDP gc still sees (also one whose
    wrapper failed to build, e.g. in an OOM trial of bench/max_model.py); the pool is reset here.
    Unlike `engine.release(chunks)`, which frees the model you hand it, this sweeps the process:
    a benchmark's tool, not something to call while a model you keep is alive."""
    engine.release(fsdp.live_modules())
    fsdp.reset_buffer_pool()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def guarded_run(cfg: EngineConfig, train: Callable[[PhasePeaks], dict], *, timeout_s: float):
    """`train(peaks)` on a fresh `runtime.init(cfg)`, with a clean slate before and after.

    An OOM or any other error comes back as text instead of propagating: in a benchmark, one
    failing variant must not hide the others. Returns (result or None, error or None, peaks, runtime);
    a config the runtime refuses (the same on every rank, before any collective) comes back as
    (None, its ConfigError, peaks, None)."""
    try:
        rt = runtime.init(cfg, timeout_s=timeout_s)
    except ConfigError as e:
        return None, f"ConfigError: {e}", PhasePeaks(), None
    free_memory()
    result, error, peaks = None, None, PhasePeaks()
    try:
        result = train(peaks)
    except torch.OutOfMemoryError as e:
        error = f"OOM: {str(e).splitlines()[0]}"
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {str(e)[:500]}"
        if rt.rank == 0:
            traceback.print_exc()
    runtime.shutdown()
    free_memory()
    return result, error, peaks, rt
