"""Timed phases of one process's work, with host and GPU memory at the end of each: what a bench prints as
"where the time goes" (bench/load_hf.py, bench/notebook_setup.py)."""
from __future__ import annotations

import gc
import resource
import time

import torch


class Phases:
    """`run(name, fn, ...)` calls `fn` and records one row: seconds (CUDA synchronized before and after, so a
    phase owns its kernels), host RSS at its end, the process's peak RSS so far (ru_maxrss: it counts mmapped
    file pages the process touched), and peak / end GPU memory allocated during it."""

    def __init__(self):
        import psutil
        self.proc, self.rows, self.gpu = psutil.Process(), [], torch.cuda.is_available()

    def run(self, name: str, fn, *args, **kwargs):
        if self.gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if self.gpu:
            torch.cuda.synchronize()
        self.rows.append(dict(
            phase=name, seconds=time.perf_counter() - t0, rss_bytes=self.proc.memory_info().rss,
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            gpu_peak_bytes=torch.cuda.max_memory_allocated() if self.gpu else 0,
            gpu_end_bytes=torch.cuda.memory_allocated() if self.gpu else 0))
        return out

    def seconds(self, *names: str) -> float:
        """Summed seconds of the named phases (all phases when none are named)."""
        return sum(r["seconds"] for r in self.rows if not names or r["phase"] in names)


def settle() -> None:
    """gc + empty_cache: what memory is left once dropped objects are really gone."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
