"""The kit's Triton kernels launched through one door (`launch`), so that a set of launches can be compiled ahead,
all at once on a pool of threads, instead of one after another at their first use (`ahead` + `compile_all`).

A kernel's first launch with a new specialisation (dtype, constexprs, integer arguments equal to 1 or divisible by
16) waits for its compile: Triton's IR passes and ptxas, 0.1-0.2 s each. The first time on a machine it also waits
for the kernel's C launcher, which Triton builds per signature with the system's C compiler (~0.3 s). The rollout
engine's first cache met ~8 such kernels one by one, in the eager warm-ups before its graph captures (on a fresh
machine, seconds of Triton's own stage times, launchers apart: docs/benchmarks.md, "The Triton kernels by default").
ptxas and the C compiler run as subprocesses and Triton's passes release the GIL in part: on this kit's 2-core CI
machine 4 kernels compiled in 0.66 s on a pool against 0.97 s one after another. So `ModelRunner.cache_for` first runs
each decode step inside `ahead()`, which records the launches instead of running them, and `compile_all` compiles and
loads what it recorded on one thread per CPU core; the warm-ups and captures then find every kernel ready.

A launch that is sure to come soon (a backward's, known from its forward) can instead be compiled on a background
thread while the caller goes on (`compile_soon`). Outside `ahead()`, `launch` is `kernel[grid](...)`. In Triton's
interpreter (TRITON_INTERPRET=1, the CPU tests) there is nothing to compile: both return at once.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch

try:
    from triton.runtime.jit import JITFunction
except ImportError:   # CPU-only torch: the kernels' modules are not imported either
    JITFunction = ()

_recording: ContextVar[list | None] = ContextVar("mfsdp_kit_triton_recording", default=None)

MAX_THREADS = 16
"""Compile threads at most (each runs ptxas or the C compiler in turn: a core each)."""


def launch(kernel, grid, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`; inside `ahead()`, recorded for `compile_all` instead (nothing runs, the
    outputs stay as they were; the record keeps a 16-element stand-in of each tensor, not the tensor)."""
    recording = _recording.get()
    if recording is None:
        kernel[grid](*args, **kwargs)
    else:
        recording.append((kernel, grid, tuple(map(_stand_in, args)), kwargs))


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
    todo = list({(kernel, specialisation(args=args, kwargs=kwargs)): (kernel, grid, args, kwargs)
                 for kernel, grid, args, kwargs in launches if isinstance(kernel, JITFunction)}.values())
    if not todo:
        return 0.0
    index = device.index if device.index is not None else torch.cuda.current_device()
    for kernel in {item[0] for item in todo}:
        kernel.device_caches[index]   # each kernel's per-device cache made here, before threads race to make it
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=min(threads or cpus, MAX_THREADS, len(todo)),
                            thread_name_prefix="mfsdp-triton") as pool:
        list(pool.map(lambda item: _compile(*item, device=index, load=True), todo))   # re-raises a compile error
    return time.perf_counter() - t0


_soon: dict = {}
"""(kernel, `specialisation`) -> the future of its background compile (`compile_soon`)."""
_soon_pool: ThreadPoolExecutor | None = None


def compile_soon(kernel, grid, *args, **kwargs) -> Future | None:
    """Compile `kernel` for these launch arguments on a background thread, once per specialisation, and return at
    once: for a launch that is sure to come (a backward's, asked for by its forward), so that it does not wait for
    its compile. The thread only compiles (no stream work or allocation: a graph being captured elsewhere is not
    disturbed); the launch loads the module. Returns the compile's future, which the launch should wait for (two
    compiles of one kernel would race to fill Triton's cache); None in Triton's interpreter."""
    global _soon_pool
    if not isinstance(kernel, JITFunction):
        return None
    key = (kernel, specialisation(args=args, kwargs=kwargs))
    if key not in _soon:
        if _soon_pool is None:
            _soon_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mfsdp-triton-soon")
        _soon[key] = _soon_pool.submit(_compile, kernel, grid, tuple(map(_stand_in, args)), kwargs,
                                       device=torch.cuda.current_device(), load=False)
    return _soon[key]


def _compile(kernel, grid, args: tuple, kwargs: dict, *, device: int, load: bool) -> None:
    """On a compile thread: Triton's `warmup` of one launch for `device` (compile, or find it compiled), and with
    `load` its module and C launcher (`.run`; only where no graph is being captured: `compile_all`)."""
    torch.cuda.set_device(device)   # Triton compiles and loads for the thread's current device
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    if load and compiled is not None:   # None: a jit_cache_hook took the compile
        compiled.run


def _stand_in(v):
    """A tensor argument as Triton sees it at compile time (dtype, 16-byte alignment) in 16 elements, so a record
    does not keep the step's activations alive; anything else as it is."""
    if not isinstance(v, torch.Tensor):
        return v
    offset = v.data_ptr() % 16 // v.element_size()   # elements past a 16-byte boundary (the allocator aligns more)
    return torch.empty(16 + offset, dtype=v.dtype, device=v.device)[offset:]


def specialisation(*, args: tuple, kwargs: dict) -> tuple:
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
