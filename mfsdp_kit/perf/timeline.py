"""A torch.profiler trace's GPU timeline: kernel intervals, their union, and exposed communication.

A GPU runs kernels on several streams at once, so summing kernel durations over-counts time: two
NCCL kernels on two streams for the same 1 ms count 2 ms. Every question here is asked of the
UNION of intervals instead (U below, overlaps counted once):
    busy           = |U(every kernel, memcpy, memset)|; idle = step wall time - busy
    NCCL exposed   = |U(nccl)| - |U(nccl) n U(compute)|: communication no compute kernel hides
Trace times are microseconds (kineto's chrome trace); summaries are seconds per step.
"""
from __future__ import annotations

import gzip
import json
from collections import namedtuple
from contextlib import contextmanager

PHASE_MARK = "mfsdp_kit::phase "
"""The profiler range name of a phase (`phase`), read back by `perf.kernel_mix.breakdown`."""


@contextmanager
def phase(name: str):
    """Mark a host range as phase `name` for `perf.kernel_mix.breakdown` (free unless torch.profiler records)."""
    from torch.profiler import record_function
    with record_function(PHASE_MARK + name):
        yield


GpuActivity = namedtuple("GpuActivity", "name kind start_us end_us")
"""One kernel, memcpy or memset of a trace; kind = "nccl" | "compute" | "memcpy"."""


def union(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint (start, end) intervals covering the same time as `intervals`."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covered(intervals) -> float:
    """Time covered by at least one interval (overlaps counted once)."""
    return sum(end - start for start, end in union(intervals))


def intersection(a, b) -> list[tuple[float, float]]:
    """Time covered by both `a` and `b` (each may overlap itself), as disjoint intervals."""
    a, b, out, i, j = union(a), union(b), [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def difference(a, b) -> list[tuple[float, float]]:
    """Time covered by `a` and not by `b`, as disjoint intervals."""
    out = []
    for start, end in union(a):
        for lo, hi in intersection([(start, end)], b):
            if lo > start:
                out.append((start, lo))
            start = hi
        if start < end:
            out.append((start, end))
    return out


def exposed(comm, compute) -> float:
    """Time some communication runs while no compute does: |U(comm)| - |U(comm) n U(compute)|."""
    return covered(comm) - covered(intersection(comm, compute))


def read_trace(path: str) -> dict:
    """A chrome trace as written by `prof.export_chrome_trace` (gzipped if the name ends in .gz)."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def gpu_activities(trace: dict) -> list[GpuActivity]:
    """Kernels, memcpys and memsets of a torch.profiler (kineto) chrome trace. NCCL kernels are
    named nccl* (ncclDevKernel_AllGather_RING_LL, ncclKernel_...); every other kernel is compute."""
    out = []
    for ev in trace.get("traceEvents", []):
        cat = str(ev.get("cat", "")).lower()
        if ev.get("ph") != "X" or cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        name = str(ev.get("name", ""))
        kind = "memcpy" if cat != "kernel" else "nccl" if name.lower().startswith("nccl") else "compute"
        start = float(ev["ts"])
        out.append(GpuActivity(name, kind, start, start + float(ev.get("dur", 0.0))))
    return out


def timeline_summary(acts: list[GpuActivity], *, wall_s: float, steps: int, top: int = 10) -> dict:
    """Seconds PER STEP of `steps` steps that took `wall_s` in all, and the `top` kernels by time."""
    per_step = lambda us: us / 1e6 / steps  # noqa: E731
    spans = {k: [(a.start_us, a.end_us) for a in acts if a.kind == k] for k in ("compute", "nccl", "memcpy")}
    busy = covered([(a.start_us, a.end_us) for a in acts])
    by_name: dict[str, list] = {}
    for a in acts:
        entry = by_name.setdefault(a.name, [a.kind, 0, 0.0])
        entry[1] += 1
        entry[2] += a.end_us - a.start_us
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][2])[:top]
    step_s = wall_s / steps
    return dict(
        steps=steps, step_s=step_s, num_activities=len(acts),
        compute_kernel_s=per_step(sum(e - s for s, e in spans["compute"])),
        nccl_kernel_s=per_step(sum(e - s for s, e in spans["nccl"])),
        memcpy_s=per_step(sum(e - s for s, e in spans["memcpy"])),
        nccl_exposed_s=per_step(exposed(spans["nccl"], spans["compute"])),
        gpu_busy_s=per_step(busy), gpu_idle_s=max(step_s - per_step(busy), 0.0),
        top_kernels=[dict(name=n[:200], kind=k, calls=c, s_per_step=per_step(us)) for n, (k, c, us) in ranked])
