"""One clock for timing device work: CUDA events on a GPU, the host clock after a synchronize elsewhere.

Why one: every bench had its own `_sync` + `perf_counter` pair or `timed_ms`, and they measured differently (one
with events, one with the host clock; two, one or no untimed calls first), so two benches' numbers of the same
work did not compare. Every bench and the rollout's per-batch timer (`rl.rollout.timing`) time through here.

On a GPU a span runs from an event recorded after the device drained (`synchronize`: nothing earlier is counted)
to an event recorded when the work was issued, read after the device drained again: the GPU's own clock, without
the host's wake-up latency after the synchronize, which is what a sub-millisecond kernel's time would be lost in.
Host work inside the span counts too (the end event is recorded when the host gets there). Work on another stream
that the current stream never waits for ends unseen, as it does for the step that follows it.

Light: only torch and the standard library at import time, so the runtime may import it (tests/test_layout.py,
`PERF_FOR_THE_RUNTIME`).
"""
from __future__ import annotations

import time
from typing import Callable

import torch


def _cuda(device) -> bool:
    """Whether `device` ("cuda", "cuda:1", a torch.device; None: this machine's default) is a GPU."""
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def synchronize(device=None) -> None:
    """Wait for the work queued on `device` (None: the GPU when there is one); a no-op for the CPU. Where the caller
    needs the work finished, not timed: copies landed before memory is freed or read."""
    if _cuda(device):
        torch.cuda.synchronize()


def mark(device=None):
    """A point in time of `device`'s work: a CUDA event recorded on the current stream (no wait), the host clock
    elsewhere. Two marks of one device give `seconds_between`."""
    if not _cuda(device):
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds_between(start, end) -> float:
    """Seconds from mark `start` to mark `end`; waits for `end` on a GPU."""
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


class timed:
    """`with timed(device=...) as t: work` then `t.seconds`: the device drained before the work, so it owns none of
    the earlier work, and after it, so it owns all of its own (see the module docstring for how it is read)."""

    def __init__(self, *, device=None):
        self.device, self.seconds = device, None

    def __enter__(self) -> "timed":
        synchronize(self.device)
        self.start = mark(self.device)
        return self

    def __exit__(self, kind, value, tb) -> None:
        end = mark(self.device)
        synchronize(self.device)
        self.seconds = seconds_between(self.start, end)


def seconds(fn: Callable, *, device=None):
    """(seconds of one call of `fn`, its result), timed as `timed` does."""
    with timed(device=device) as t:
        out = fn()
    return t.seconds, out


def mean_ms(fn: Callable, *, repeats: int, warmup: int, device=None) -> float:
    """Mean milliseconds of `fn` over `repeats` calls back to back, after `warmup` untimed ones (compiles, caches,
    allocator pools). Back to back: the host queues call i+1 while the device runs call i, as a training step does."""
    for _ in range(warmup):
        fn()
    with timed(device=device) as t:
        for _ in range(repeats):
            fn()
    return t.seconds * 1e3 / repeats
