"""One rank's step as a timeline: compute, each collective, and the communication nothing hides.

`profile_steps` runs a few steps of a `perf.trainers.Trainer` under torch.profiler and turns the
trace into `Event`s (seconds from the step's start) of a few kinds: compute, all_gather,
reduce_scatter, all_reduce, other_comm (broadcast, send/recv), wait.

On GPUs the timeline is the device's: kernels on their streams, NCCL kernels named by collective
(ncclDevKernel_AllGather_RING_LL, ...), every other kernel, memcpy and memset compute. Exposed
communication is NCCL kernel time during which no compute kernel runs (as perf.timeline).

On CPU with gloo (torch 2.13) a collective leaves two records: the training thread's call
(`c10d::allgather_into_tensor_coalesced_`, `c10d::reduce_scatter_tensor_coalesced_`, ...: short when
it only enqueues async work, long when the call blocks) and the transfer on one of gloo's worker
threads (user annotations `gloo:all_gather`, `gloo:all_reduce`, `gloo:broadcast`). gloo runs a
reduce-scatter as an all-reduce, so a worker's `gloo:all_reduce` takes the kind of the latest
collective call the training thread made before it started. `work.wait()` leaves no record
(FSDP2's own `FSDP::post_backward_rs_wait` annotations do, kind wait). Compute is the training
thread's leaf ops (aten ops with no op inside them). So on CPU:
    exposed = communication (worker transfers, collective calls, waits) while the training thread
              runs no compute op: the time it is blocked in a collective call or waiting for one
              (Python between ops during a transfer counts too: a slight over-count).
"""
from __future__ import annotations

import os
import tempfile
from collections import namedtuple

import torch

from .timeline import covered, difference, read_trace

Event = namedtuple("Event", "name kind start_s end_s lane step")
"""One op, transfer or kernel of a profiled step; start_s/end_s in seconds from the start of
step `step`; lane: "main" (the training thread), "gloo" (a gloo worker thread) or "stream N"."""
COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "other_comm", "wait")
KINDS = ("compute",) + COMM_KINDS
STEP_MARK = "mfsdp_kit::step "


def comm_kind(name: str) -> str | None:
    """The kind of a collective named `name` (a c10d op, gloo annotation or NCCL kernel), None if
    it is none: all_gather | reduce_scatter | all_reduce | other_comm | wait."""
    n = name.lower().replace("_", "")
    if "wait" in n and ("c10d" in n or "fsdp" in n):
        return "wait"
    if not n.startswith(("c10d::", "c10dfunctional::", "gloo:", "nccl")):
        return None
    for key, kind in (("reducescatter", "reduce_scatter"), ("allgather", "all_gather"), ("allreduce", "all_reduce")):
        if key in n:
            return kind
    return "other_comm"


def _gpu_events(evs) -> list[tuple]:
    out = []
    for ev in evs:
        cat = str(ev.get("cat", "")).lower()
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            name = str(ev.get("name", ""))
            kind = (comm_kind(name) if name.lower().startswith("nccl") else None) or "compute"
            out.append((name, kind, float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0)), f"stream {ev.get('tid')}"))
    return out


def _cpu_events(evs, main_tid) -> list[tuple]:
    main = sorted((e for e in evs if e.get("tid") == main_tid and e.get("cat") in ("cpu_op", "user_annotation")),
                  key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
    out, stack, calls = [], [], []   # stack: open cpu ops [end, has_child, event]; calls: (start, kind)

    def close(entry):
        _, has_child, e = entry
        if not has_child and comm_kind(e["name"]) is None:   # a leaf op: real work, not a range around it
            out.append((e["name"], "compute", float(e["ts"]), float(e["ts"]) + float(e["dur"]), "main"))
    for e in main:
        start, end, kind = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), comm_kind(e["name"])
        while stack and stack[-1][0] <= start:
            close(stack.pop())
        if kind is not None:
            out.append((e["name"], kind, start, end, "main"))
            if kind != "wait":
                calls.append((start, kind))
        if e["cat"] == "cpu_op":
            if stack:
                stack[-1][1] = True
            stack.append([end, False, e])
    while stack:
        close(stack.pop())
    for e in evs:   # gloo's worker threads: the transfers
        if e.get("tid") != main_tid and str(e.get("name", "")).startswith("gloo:"):
            start = float(e["ts"])
            kind = comm_kind(e["name"])
            if kind == "all_reduce":   # gloo reduce-scatters by all-reducing: ask the call that queued it
                kind = max((c for c in calls if c[0] <= start), default=(0, kind))[1]
            out.append((e["name"], kind, start, start + float(e.get("dur", 0)), "gloo"))
    return out


def trace_events(trace: dict, *, on_gpu: bool) -> tuple[list[Event], list[tuple[float, float]]]:
    """A chrome trace of `profile_steps` -> (events, step spans); times in seconds from the first
    step's start, each event clipped to its step and timed from that step's start."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    marks = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["tid"]) for e in evs  # CPU side only
                   if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(STEP_MARK))
    if not marks:
        return [], []
    raw = _gpu_events(evs) if on_gpu else _cpu_events(evs, marks[0][2])
    t0 = marks[0][0]
    spans = [((s - t0) / 1e6, (e - t0) / 1e6) for s, e, _ in marks]
    out = []
    for name, kind, start, end, lane in raw:
        for i, (s, e, _) in enumerate(marks):
            lo, hi = max(start, s), min(end, e)
            if lo < hi or (lo == hi and s <= start < e):
                out.append(Event(name, kind, (lo - s) / 1e6, (hi - s) / 1e6, lane, i))
    return sorted(out, key=lambda ev: (ev.step, ev.start_s)), spans


def profile_steps(trainer, batches, *, steps: int, first_step: int = 0) -> tuple[list[Event], list[tuple[float, float]]]:
    """Run `steps` steps of `trainer` (on batches[first_step:]) under torch.profiler on this rank;
    returns (events of every step, (start_s, end_s) of each step from the first one's start).

    Each step ends with a device synchronize, so its kernels lie inside its span. The steps
    settle INSIDE the profiled region: a gloo handle made under the profiler and freed after it
    stopped crashes the process at gc (torch 2.13 CPU, see bench/throughput.profile_steps)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    from .trainers import run_step
    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities, acc_events=True) as prof:   # one cycle: the same events, no warning
        for i in range(first_step, first_step + steps):
            with record_function(f"{STEP_MARK}{i - first_step}"):
                run_step(trainer, batches[i % len(batches)], i)
                if on_gpu:
                    torch.cuda.synchronize()
        trainer.settle()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        return trace_events(read_trace(path), on_gpu=on_gpu)
    finally:
        os.remove(path)


def _spans(events, kinds, lane=None):
    return [(e.start_s, e.end_s) for e in events if e.kind in kinds and (lane is None or e.lane == lane)]


def exposed_intervals(events) -> list[tuple[float, float]]:
    """Communication (every kind of COMM_KINDS) while no compute runs, as disjoint intervals.
    Compute the training thread's own collective calls and waits enclose does not hide anything."""
    compute = difference(_spans(events, ("compute",)), _spans(events, COMM_KINDS, lane="main"))
    return difference(_spans(events, COMM_KINDS), compute)


def step_breakdown(events, spans) -> dict:
    """Seconds PER STEP (mean over `spans`): step, compute, comm (|U| of every communication kind),
    exposed comm, idle (neither compute nor comm); and calls per step of each kind."""
    n = max(len(spans), 1)
    rows = dict(step_s=0.0, compute_s=0.0, comm_s=0.0, exposed_comm_s=0.0, idle_s=0.0)
    for i, (s, e) in enumerate(spans):
        mine = [ev for ev in events if ev.step == i]
        comm, compute = _spans(mine, COMM_KINDS), _spans(mine, ("compute",))
        rows["step_s"] += e - s
        rows["compute_s"] += covered(difference(compute, _spans(mine, COMM_KINDS, lane="main")))
        rows["comm_s"] += covered(comm)
        rows["exposed_comm_s"] += covered(exposed_intervals(mine))
        rows["idle_s"] += max(e - s - covered(comm + compute), 0.0)
    out = {k: v / n for k, v in rows.items()}
    for kind in COMM_KINDS:   # a collective's call and its transfer are one collective: count calls
        out[f"{kind}_calls"] = sum(ev.kind == kind and ev.lane != "gloo" for ev in events) / n
    return out


def format_breakdown(rows: dict[str, dict]) -> str:
    """A text table of `step_breakdown`s, one row per run (ms per step)."""
    cols = ("step_s", "compute_s", "comm_s", "exposed_comm_s", "idle_s")
    lines = [f"{'':<16}" + "".join(f"{c[:-2] + ' ms':>18}" for c in cols)]
    lines += [f"{name:<16}" + "".join(f"{r[c] * 1e3:>18.2f}" for c in cols) for name, r in rows.items()]
    return "\n".join(lines)


def profile_mode(mode: str, spec, *, dtype: str, micro_batch_size: int, steps: int = 2, warmup: int = 1,
                 attention: str = "sdpa") -> tuple[list[Event], list[tuple[float, float]]]:
    """Variant `mode` (perf.variants: "ddp", "fsdp", "fsdp2", ...) of the GPT `spec` on this world:
    `warmup` unprofiled steps, then `profile_steps` of `steps` steps, one micro-batch per rank each."""
    from ..distributed import runtime
    from ..train.options import StepOptions
    from .trainers import batches, build_trainer, run_step
    from .variants import engine_config
    cfg = engine_config(mode, spec, dtype=dtype, attention=attention,
                        fsdp_overrides=dict(overlap_param_gather=True), ddp_overrides=dict(overlap_grad_reduce=True))
    rt = runtime.init(cfg)
    trainer = build_trainer(mode, cfg, spec, options=StepOptions(micro_batch_size=micro_batch_size))
    data = batches(spec, n=warmup + steps, global_batch=micro_batch_size * rt.world_size)
    for i in range(warmup):
        run_step(trainer, data[i], i)
    trainer.settle()
    return profile_steps(trainer, data, steps=steps, first_step=warmup)
