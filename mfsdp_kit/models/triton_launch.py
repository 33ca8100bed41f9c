"""The kit's Triton kernels launched through one door (`launch`), so that a set of launches can be compiled ahead,
all at once on a pool of threads, instead of one after another at their first use (`ahead` + `compile_all`).

A kernel's first launch with a new specialisation (dtype, constexprs, integer arguments equal to 1 or divisible by
16) waits for its compile: Triton's IR passes and ptxas, 0.1-0.2 s each. The first time on a machine it also waits
for the kernel's C launcher, which Triton builds per signature with the system's C compiler. The rollout engine's
first cache compiles ~8 such kernels inside its graph captures, one by one (a fresh 1 H100: 14 kit kernels in 2.29
s of Triton's own stage times, launchers apart; docs/benchmarks.md). Triton's passes, ptxas and the C compiler
release the GIL: on this kit's 2-core CI machine 4 kernels compiled in 0.66 s on a pool against 1.53 s one after
another. So `Runner.cache_for` first runs each decode step inside `ahead()`, which records the launches instead of
running them, and `compile_all` compiles and loads what it recorded on one thread per CPU core; the captures then
find every kernel ready.

A launch that is sure to come soon (a backward's, known from its forward) can instead be compiled on a background
thread while the caller goes on (`compile_soon`). Nothing changes outside `ahead()`: `launch` is `kernel[grid](...)`. In Triton's interpreter (TRITON_INTERPRET=1,
the CPU tests) there is nothing to compile: `compile_all` returns at once.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch

_recording: ContextVar[list | None] = ContextVar("mfsdp_kit_triton_recording", default=None)

MAX_THREADS = 16
"""Compile threads at most (each runs ptxas or the C compiler in turn: a core each)."""


def launch(kernel, grid, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`; inside `ahead()`, recorded for `compile_all` instead (nothing runs, the
    outputs stay as they were)."""
    recording = _recording.get()
    if recording is None:
        kernel[grid](*args, **kwargs)
    else:
        recording.append((kernel, grid, args, kwargs))


@contextmanager
def ahead() -> Iterator[list]:
    """Record every `launch` inside instead of running it; yields the list of launches (kernel, grid, args,
    kwargs), for `compile_all`. Torch ops inside still run, on whatever the unrun kernels left in their outputs."""
    launches: list = []
    token = _recording.set(launches)
    try:
        yield launches
    finally:
        _recording.reset(token)


def compile_all(launches: list, *, device: torch.device, threads: int | None = None) -> float:
    """Compile each distinct specialisation among `launches` (Triton's `warmup`: compile, no launch) and load it
    (module and C launcher), on `threads` threads (default: this process's CPUs, at most `MAX_THREADS`); a kernel
    already compiled in this process costs nothing, one in Triton's disk cache a load. Returns the seconds taken."""
    t0 = time.perf_counter()
    todo = list({(kernel, specialisation(args, kwargs)): (kernel, grid, args, kwargs)
                 for kernel, grid, args, kwargs in launches}.values())
    from triton.runtime.jit import JITFunction
    todo = [item for item in todo if isinstance(item[0], JITFunction)]   # the interpreter's kernels compile nothing
    if not todo:
        return 0.0
    index = device.index if device.index is not None else torch.cuda.current_device()
    for kernel in {item[0] for item in todo}:
        kernel.device_caches[index]   # each kernel's per-device cache made here, before threads race to make it

    def one(item) -> None:
        kernel, grid, args, kwargs = item
        torch.cuda.set_device(index)   # Triton compiles and loads for the thread's current device
        kernel.warmup(*args, grid=grid, **kwargs).run   # `.run` loads the module and builds the launcher

    workers = min(threads or len(os.sched_getaffinity(0)), MAX_THREADS, len(todo))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mfsdp-triton") as pool:
        list(pool.map(one, todo))   # re-raises a compile error here
    return time.perf_counter() - t0


_soon: dict = {}
"""(kernel, `specialisation`) -> the future of its background compile (`compile_soon`)."""
_soon_pool: ThreadPoolExecutor | None = None


def compile_soon(kernel, grid, *args, **kwargs):
    """Compile `kernel` for these launch arguments on a background thread, once per specialisation, and return at
    once: for a launch that is sure to come (a backward's, asked for by its forward), so that it does not wait for
    its compile. The thread only compiles (no CUDA call: a graph being captured elsewhere is not disturbed); the
    launch loads the module. Returns the compile's future (None in Triton's interpreter, where nothing compiles)."""
    from triton.runtime.jit import JITFunction
    global _soon_pool
    if not isinstance(kernel, JITFunction):
        return None
    key = (kernel, specialisation(args, kwargs))
    if key not in _soon:
        if _soon_pool is None:
            _soon_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mfsdp-triton-soon")
        device = torch.cuda.current_device()

        def compile_only():
            torch.cuda.set_device(device)
            kernel.warmup(*args, grid=grid, **kwargs)
        _soon[key] = _soon_pool.submit(compile_only)
    return _soon[key]


def specialisation(args: tuple, kwargs: dict) -> tuple:
    """What Triton specialises a kernel on, roughly, so that two launches of one kernel compile once: of a positional
    argument, a tensor's dtype and 16-byte alignment, an integer's being 1, divisible by 16, or past 32 bits, a
    float's type; every keyword argument (the kit passes constexprs and launch options by keyword) by its value.
    Launches that differ only in what Triton does not look at share one compile; a miss compiles twice, never
    wrongly."""
    def key(v):
        if isinstance(v, torch.Tensor):
            return ("tensor", v.dtype, v.data_ptr() % 16 == 0)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return v
        if isinstance(v, float):
            return "float"
        return ("int", v == 1, v % 16 == 0, -2 ** 31 <= v < 2 ** 31)
    return tuple(key(v) for v in args) + tuple(sorted(kwargs.items()))
