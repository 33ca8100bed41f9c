"""Where a phase's time goes on the GPU: kernel time by class, and the host gaps between kernels.

A phase is a host-side range that the library marks with `timeline.phase(name)` (`torch.profiler.record_function`
"mfsdp_kit::phase NAME": free when no profiler runs). The RL loop marks sync, rollout, logprobs and update; each
ends by reading its result on the host, so every kernel it launched has run before the range closes and a phase's
kernels are the ones that start inside it.

Per phase: wall seconds, seconds of each kernel class (a kernel's name decides its class, first match in
`KERNEL_CLASSES`; overlapping kernels of one class counted once), and the host gap: wall time in which no kernel
runs at all, what the device waits on Python, the allocator or a sync. What the host was doing then: the host
events (`HOST_CATS`: aten ops, marked ranges, CUDA runtime calls) that overlap the gaps, by name (`gap_ops`).
"""
from __future__ import annotations

from bisect import bisect_right

from .timeline import PHASE_MARK, covered, difference, gpu_activities

KERNEL_CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "matmul", "splitk")),
    ("loss", ("cross_entropy", "nll_loss", "log_softmax", "logsoftmax")),
    ("copy", ("memcpy", "memset", "copy", "catarray", "index", "scatter", "gather")),
)
"""(class, lower-case name fragments), first match wins; everything else is "other" (elementwise, norms,
reductions, sampling)."""
CLASSES = tuple(name for name, _ in KERNEL_CLASSES) + ("other",)
HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function")
"""A chrome trace's host event categories that `gap_ops` attributes host gaps to."""


def classify(kernel: str) -> str:
    """The class of a GPU activity named `kernel` (module docstring)."""
    low = kernel.lower()
    return next((name for name, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")


def host_events(trace: dict) -> list[tuple[str, str, float, float]]:
    """(name, category, start_us, end_us) of the trace's host events (`HOST_CATS`), phase marks left out."""
    return [(str(e.get("name", "")), e["cat"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
            for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in HOST_CATS
            and not str(e.get("name", "")).startswith(PHASE_MARK)]


def gap_ops(events, gaps: list[tuple[float, float]], *, top: int) -> list[list]:
    """The `top` host event names by their seconds inside `gaps` (sorted disjoint intervals, us), [[name, category,
    seconds, events], ...]. Inclusive: an op's children count in it too, so an outer range and its inner ops can
    both rank; time no event covers (plain Python between ops) ranks under no name."""
    starts = [s for s, _ in gaps]
    names: dict[tuple[str, str], list] = {}
    for name, cat, start, end in events:
        i, seconds = max(bisect_right(starts, start) - 1, 0), 0.0
        while i < len(gaps) and gaps[i][0] < end:
            seconds += max(0.0, min(end, gaps[i][1]) - max(start, gaps[i][0]))
            i += 1
        if seconds > 0:
            entry = names.setdefault((name, cat), [0.0, 0])
            entry[0] += seconds / 1e6
            entry[1] += 1
    ranked = sorted(names.items(), key=lambda kv: -kv[1][0])[:top]
    return [[name, cat, seconds, n] for (name, cat), (seconds, n) in ranked]


def breakdown(trace: dict, *, top: int = 12) -> dict[str, dict]:
    """{phase: {"wall_s", "kernels_s" (their union), one "<class>_s" per class, "host_gap_s", "kernels": n,
    "top": the `top` kernel names by summed seconds, [[name, class, seconds, launches], ...], "gap_ops": the `top`
    host events by seconds inside the host gaps (`gap_ops`)}} of a chrome trace (`read_trace`); a phase marked more
    than once adds up."""
    marks = [(e["name"][len(PHASE_MARK):], float(e["ts"]), float(e["ts"]) + float(e["dur"]))
             for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "user_annotation"
             and str(e.get("name", "")).startswith(PHASE_MARK)]
    acts, host = gpu_activities(trace), host_events(trace)
    out: dict[str, dict] = {}
    for name, start, end in marks:
        inside = [a for a in acts if start <= a.start_us < end]
        mine = [(max(a.start_us, start), min(a.end_us, end), classify(a.name)) for a in inside]
        row = out.setdefault(name, dict(wall_s=0.0, kernels_s=0.0, host_gap_s=0.0, kernels=0,
                                        **{f"{c}_s": 0.0 for c in CLASSES}))
        gaps = difference([(start, end)], [(s, e) for s, e, _ in mine])
        row.setdefault("_gap_events", []).extend((n, c, max(s, start), min(e, end)) for n, c, s, e in host
                                                 if s < end and e > start)
        row.setdefault("_gaps", []).extend(gaps)
        busy = covered([(s, e) for s, e, _ in mine]) / 1e6
        row["wall_s"] += (end - start) / 1e6
        row["kernels_s"] += busy
        row["host_gap_s"] += (end - start) / 1e6 - busy
        row["kernels"] += len(mine)
        for c in CLASSES:
            row[f"{c}_s"] += covered([(s, e) for s, e, k in mine if k == c]) / 1e6
        names = row.setdefault("_names", {})
        for a in inside:
            seconds, launches = names.get(a.name, (0.0, 0))
            names[a.name] = (seconds + (a.end_us - a.start_us) / 1e6, launches + 1)
    for row in out.values():
        names = row.pop("_names")
        row["top"] = [[n, classify(n), s, k] for n, (s, k) in sorted(names.items(), key=lambda x: -x[1][0])[:top]]
        row["gap_ops"] = gap_ops(row.pop("_gap_events"), sorted(row.pop("_gaps")), top=top)
    return out


def format_breakdown(rows: dict[str, dict]) -> str:
    """A table: one line per phase, seconds per class."""
    cols = ("wall_s", *[f"{c}_s" for c in CLASSES], "host_gap_s")
    lines = [f"{'phase':<10}" + "".join(f"{c[:-2]:>11}" for c in cols) + f"{'kernels':>9}"]
    for name, r in rows.items():
        lines.append(f"{name:<10}" + "".join(f"{r[c]:>11.3f}" for c in cols) + f"{r['kernels']:>9}")
    for name, r in rows.items():
        lines += [f"  {name} top: {s:.3f} s {k:>6}x {c:<9} {n[:90]}" for n, c, s, k in r.get("top", [])]
        lines += [f"  {name} in host gaps: {s:.3f} s {k:>6}x {c:<15} {n[:80]}" for n, c, s, k in r.get("gap_ops", [])]
    return "\n".join(lines)
