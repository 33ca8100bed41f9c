"""Where a phase's time goes on the GPU: kernel time by class, and the host gaps between kernels.

A phase is a host-side range that the library marks with `timeline.phase(name)` (`torch.profiler.record_function`
"mfsdp_kit::phase NAME": free when no profiler runs). The RL loop marks sync, rollout, logprobs and update; each
ends by reading its result on the host, so every kernel it launched has run before the range closes and a phase's
kernels are the ones that start inside it.

Per phase: wall seconds, seconds of each kernel class (a kernel's name decides its class, first match in
`KERNEL_CLASSES`; overlapping kernels of one class counted once), and the host gap: wall time in which no kernel
runs at all, what the device waits on Python, the allocator or a sync.
"""
from __future__ import annotations

from .timeline import PHASE_MARK, covered, gpu_activities

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


def classify(kernel: str) -> str:
    """The class of a GPU activity named `kernel` (module docstring)."""
    low = kernel.lower()
    return next((name for name, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")


def breakdown(trace: dict, *, top: int = 12) -> dict[str, dict]:
    """{phase: {"wall_s", "kernels_s" (their union), one "<class>_s" per class, "host_gap_s", "kernels": n,
    "top": the `top` kernel names by summed seconds, [[name, class, seconds, launches], ...]}} of a chrome trace
    (`read_trace`); a phase marked more than once adds up."""
    marks = [(e["name"][len(PHASE_MARK):], float(e["ts"]), float(e["ts"]) + float(e["dur"]))
             for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "user_annotation"
             and str(e.get("name", "")).startswith(PHASE_MARK)]
    acts = gpu_activities(trace)
    out: dict[str, dict] = {}
    for name, start, end in marks:
        inside = [a for a in acts if start <= a.start_us < end]
        mine = [(max(a.start_us, start), min(a.end_us, end), classify(a.name)) for a in inside]
        row = out.setdefault(name, dict(wall_s=0.0, kernels_s=0.0, host_gap_s=0.0, kernels=0,
                                        **{f"{c}_s": 0.0 for c in CLASSES}))
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
    return out


def format_breakdown(rows: dict[str, dict]) -> str:
    """A table: one line per phase, seconds per class."""
    cols = ("wall_s", *[f"{c}_s" for c in CLASSES], "host_gap_s")
    lines = [f"{'phase':<10}" + "".join(f"{c[:-2]:>11}" for c in cols) + f"{'kernels':>9}"]
    for name, r in rows.items():
        lines.append(f"{name:<10}" + "".join(f"{r[c]:>11.3f}" for c in cols) + f"{r['kernels']:>9}")
    for name, r in rows.items():
        lines += [f"  {name} top: {s:.3f} s {k:>6}x {c:<9} {n[:90]}" for n, c, s, k in r.get("top", [])]
    return "\n".join(lines)
