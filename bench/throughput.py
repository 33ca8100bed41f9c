"""Throughput, MFU and memory per GPU: megatron DDP vs Megatron-FSDP vs PyTorch FSDP2, one run.

    torchrun --nproc_per_node 2 bench/throughput.py --spec 1.7b --attention sdpa \\
        --micro-batch-size 4 --global-batch 16 --steps 8 --warmup 2 --out runs/bench/throughput.json
    torchrun --nproc_per_node 2 bench/throughput.py --spec 1.7b --attention sdpa --profile \\
        --modes ddp,fsdp,fsdp2,fsdp-no-overlap,fsdp-unit2x,fsdp-recompute,fsdp-optoffload
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/throughput.py --spec tiny --steps 3   # CPU

All modes train the SAME megatron GPT (local spec, same attention backend, seed, batches):
- ddp:   megatron DistributedDataParallel + distributed optimizer (ZeRO-1), bf16 Float16Module;
- fsdp:  Megatron-FSDP, optim_grads_params (ZeRO-3) + `--fsdp-overrides`;
- fsdp2: torch `fully_shard` per TransformerLayer then the root, MixedPrecisionPolicy(bf16
         params, fp32 reduce), torch AdamW (fused on GPU) on the fp32 sharded params.
Named variants change one knob of `fsdp` (mfsdp_kit.perf.variants.VARIANTS), so each knob is
measured in the same run as its baseline: fsdp-no-overlap, fsdp-unit2x, fsdp-unit-1e9, fsdp-recompute, fsdp-optoffload, the levers of issue 22,
fsdp-unfused (with --fused-kernels: the same model without them).
Each mode runs in turn in the same processes; memory is freed between modes and an OOM (or
any error) is recorded for that mode and the next one runs. --repeats R runs the whole list of
modes R times, interleaved (ddp, fsdp, fsdp2, ddp, fsdp, ...), so slow drift of the node (clocks,
temperature) spreads over every mode; a mode's step time and tokens/s are then the median over
its runs (each run's own median step), `runs` keeps every run's numbers. The JSON is rewritten
after every run, so a run cut off by a time limit keeps what it measured.

FLOPs per token (MFU, not HFU: recompute is not counted), PaLM's accounting (mfsdp_kit.perf.flops):
    6 * N  +  12 * L * H * S,  N = every parameter but the input embedding table;
    MFU = tokens/s/GPU * FLOPs per token / 989e12 (H100/H200 dense bf16 peak).

--profile: after the timed steps, 2 more steps of ddp / fsdp / fsdp2 (--profile-modes) run under
torch.profiler; rank 0 writes a chrome trace next to --out (<out>.<mode>.trace.json.gz, open it in
ui.perfetto.dev) and reads its GPU timeline back: per step, the time of compute kernels and of NCCL
kernels (sums), the NCCL time NOT hidden behind compute (exposed: |U(nccl)| - |U(nccl) n U(compute)|,
U = union of kernel intervals over all streams: mfsdp_kit.perf.timeline), the GPU idle time (step wall time - |U(every
kernel, memcpy, memset)|) and the 10 kernels that took longest. The profiled steps carry the
profiler's own overhead: compare their shares, not their wall time, with the timed steps.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from mfsdp_kit.distributed import runtime
from mfsdp_kit.config import EngineConfig
from mfsdp_kit.train import Batch, StepOptions
from mfsdp_kit.distributed.memory import zero_formula_bytes
from mfsdp_kit.models.gpt import SPECS, GPTSpec
from mfsdp_kit.perf import options
from mfsdp_kit.perf.flops import PEAK_FLOPS_PER_GPU, flops_per_token, matmul_params, mfu
from mfsdp_kit.perf.peaks import PhasePeaks, guarded_run
from mfsdp_kit.perf.timeline import gpu_activities, read_trace, timeline_summary
from mfsdp_kit.perf.trainers import Trainer, batches, build_trainer, run_step
from mfsdp_kit.perf.variants import (TRAINERS, VARIANTS, add_engine_args, add_step_args, engine_config_from_args,
                                     parse_modes, trainer_of, variant_overrides)
from mfsdp_kit.distributed import clock
from mfsdp_kit.perf.report import table_row, units, write_json

PROFILE_STEPS = 2


# ---- profiler ---------------------------------------------------------------------------------
def profile_steps(trainer: Trainer, data: list[Batch], trace_path: str) -> dict:
    """Run PROFILE_STEPS steps under torch.profiler (CUDA kernels on GPU, CPU ops only on CPU);
    rank 0 exports the chrome trace to `trace_path` and summarises its GPU timeline.

    The steps settle INSIDE the profiled region: a communication handle created under the
    profiler and freed after it stopped crashed the process (gloo's async work keeps the
    profiler's thread-local state; seen as a segfault in gc, torch 2.13 CPU)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    clock.synchronize()
    with profile(activities=activities) as prof, clock.timed() as t:
        for i in range(PROFILE_STEPS):
            run_step(trainer, data[i % len(data)], i)
        trainer.settle()
    wall_s = t.seconds
    if dist.get_rank() != 0:
        return dict(steps=PROFILE_STEPS, step_s=wall_s / PROFILE_STEPS)
    try:  # a trace we cannot write or read must not cost the mode its throughput numbers
        os.makedirs(os.path.dirname(trace_path) or ".", exist_ok=True)
        prof.export_chrome_trace(trace_path)
        summary = timeline_summary(gpu_activities(read_trace(trace_path)), wall_s=wall_s, steps=PROFILE_STEPS)
    except Exception as e:  # noqa: BLE001
        return dict(steps=PROFILE_STEPS, step_s=wall_s / PROFILE_STEPS, error=f"{type(e).__name__}: {e}"[:300])
    return dict(summary, trace=trace_path, trace_bytes=os.path.getsize(trace_path))


def trace_path(out: str, mode: str) -> str:
    return f"{os.path.splitext(out)[0]}.{mode}.trace.json.gz"


# ---- timing ------------------------------------------------------------------------------------
def _one_by_one(trainer: Trainer, data: list[Batch]) -> tuple[list[float], list[float]]:
    """(seconds, loss) per step, each step alone: the device synchronized before it starts and after it ends."""
    times, losses = [], []
    for i, b in enumerate(data):
        with clock.timed() as t:
            losses.append(run_step(trainer, b, i))
        times.append(t.seconds)
    return times, losses


def _pipelined(trainer: Trainer, data: list[Batch]) -> tuple[list[float], list[float]]:
    """(seconds, loss) per step of a loop that starts step i+1 before it reads step i's loss, as a training
    loop that logs every step can: a step's time is from one loss read to the next (the first: from the start).
    The host clock, not `clock.mark`: an event recorded after a read would wait for step i+1, already queued."""
    times, losses = [], []
    clock.synchronize()
    last = time.perf_counter()
    pending = trainer.start(data[0], 0)
    for i in range(1, len(data) + 1):
        following = trainer.start(data[i], i) if i < len(data) else None
        losses.append(pending())
        now = time.perf_counter()
        times.append(now - last)
        last, pending = now, following
    return times, losses


# ---- one mode, guarded ----------------------------------------------------------------------
def _train(mode: str, cfg: EngineConfig, spec: GPTSpec, data: list[Batch], args, peaks: PhasePeaks,
           profile: bool) -> dict:
    """Build, time every step of `data`, report memory, optionally profile. The model lives in
    this frame only, so it is freed when this returns or its exception is handled."""
    trainer = build_trainer(mode, cfg, spec, options=options.build(StepOptions, args, prefix=""), peaks=peaks)
    times, losses = (_pipelined if args.pipelined else _one_by_one)(trainer, data)
    memory = trainer.memory()  # its activation peak: whole run, not since the last phase reset
    memory["activations_peak_bytes"] = max(peaks.overall() - memory["model_state_bytes"], 0)
    out = dict(times=times, losses=losses, memory=memory, phase_peaks=dict(peaks.peaks))
    if profile:
        out["profile"] = profile_steps(trainer, data, trace_path(args.out, mode))
    trainer.settle()
    return out


def run_mode(mode: str, spec: GPTSpec, data: list[Batch], args, *, profile: bool) -> dict:
    start = time.perf_counter()
    out = _run_mode(mode, spec, data, args, profile=profile)
    return dict(out, wall_s=time.perf_counter() - start)


def _run_mode(mode: str, spec: GPTSpec, data: list[Batch], args, *, profile: bool) -> dict:
    cfg = engine_config_from_args(args, mode, spec)
    result, error, peaks, rt = guarded_run(cfg, lambda peaks: _train(mode, cfg, spec, data, args, peaks, profile),
                                           timeout_s=args.timeout_s)
    peak = peaks.overall()
    kind = trainer_of(mode)
    variant = dict(trainer=kind, overrides=variant_overrides(mode, spec), config=cfg.to_dict())
    if error is not None:
        return dict(mode=mode, error=error, peak_bytes=peak, variant=variant)
    measured = result["times"][args.warmup:] or result["times"]
    step_s = statistics.median(measured)
    tokens_per_s_gpu = len(data[0].tokens) * spec.seq_len_tokens / step_s / rt.world_size
    mem = result["memory"]
    formula = zero_formula_bytes(num_params=spec.param_count(), dp_size=rt.dp_size, fsdp=kind != "ddp",
                                 dtype=args.dtype)
    return dict(mode=mode, variant=variant, step_s=step_s, step_times_s=result["times"], losses=result["losses"],
                tokens_per_s_per_gpu=tokens_per_s_gpu,
                mfu=mfu(tokens_per_s_gpu, spec),
                peak_bytes=peak, phase_peak_bytes=result["phase_peaks"], memory=mem, zero_formula_bytes=formula,
                model_state_vs_16_bytes_per_param=mem["model_state_bytes"] / (16 * spec.param_count() / rt.dp_size),
                **({"profile": result["profile"]} if "profile" in result else {}))


def combine_runs(runs: list[dict], spec: GPTSpec) -> dict:
    """One mode's repeats as one result: the first good run's fields with step_s, tokens/s and MFU
    the median over the good runs and peak_bytes their max; `runs` lists each run's numbers."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    tokens = statistics.median(r["tokens_per_s_per_gpu"] for r in good)
    keep = ("step_s", "tokens_per_s_per_gpu", "peak_bytes", "wall_s")
    return dict(good[0], step_s=statistics.median(r["step_s"] for r in good), tokens_per_s_per_gpu=tokens,
                mfu=mfu(tokens, spec), peak_bytes=max(r["peak_bytes"] for r in good),
                runs=[{k: r.get(k) for k in keep + ("error",) if k in r} for r in runs])


# ---- report --------------------------------------------------------------------------------
def print_report(results: dict, spec: GPTSpec, args, world: int) -> None:
    gib, unit, scale, pu = units(spec.param_count())
    print(f"\n{args.spec}: {spec.param_count() / scale:.3f} {pu} params (N for FLOPs = {matmul_params(spec) / scale:.3f} {pu}, "
          f"input embedding excluded), L={spec.num_layers} H={spec.hidden_size} S={spec.seq_len_tokens}, "
          f"{args.dtype}, attention={args.attention}, recompute={args.recompute}, "
          f"fused_kernels={args.fused_kernels}, fused_cross_entropy={args.fused_cross_entropy}, world={world}, "
          f"{'pipelined steps (start_step)' if args.pipelined else 'each step timed alone'}, "
          f"micro-batch {args.micro_batch_size}, global batch {args.global_batch} x {spec.seq_len_tokens} tokens")
    print(f"FLOPs/token = 6*N + 12*L*H*S = {flops_per_token(spec) / 1e9:.2f} GFLOP; "
          f"MFU peak {PEAK_FLOPS_PER_GPU / 1e12:.0f} TFLOP/s/GPU (bf16 dense H100/H200)")
    for m in results:
        if m not in TRAINERS:
            print(f"  {m} = {trainer_of(m)} + {variant_overrides(m, spec)}")
    print(f"{'':<30}" + "".join(f"{m:>16}" for m in results))
    print(table_row("step s (median)", results, lambda r: f"{r['step_s']:.4f}"))
    print(table_row("tokens/s/GPU", results, lambda r: f"{r['tokens_per_s_per_gpu']:,.0f}"))
    if any(len(r.get("runs", ())) > 1 for r in results.values()):
        print(table_row("  each run, k tokens/s", results,
                   lambda r: "/".join(f"{x['tokens_per_s_per_gpu'] / 1e3:.1f}" for x in r["runs"] if "error" not in x)))
    print(table_row("MFU %", results, lambda r: f"{100 * r['mfu']:.1f}"))
    print(table_row(f"peak {unit}/GPU", results, lambda r: f"{r['peak_bytes'] / gib:.2f}"))
    for phase in ("forward_backward", "optimizer_step"):
        print(table_row(f"  peak in {phase}", results, lambda r: f"{r['phase_peak_bytes'][phase] / gib:.2f}"))
    print(table_row(f"model state {unit}/GPU", results, lambda r: f"{r['memory']['model_state_bytes'] / gib:.3f}"))
    print(table_row("  / (16 B * params / dp)", results, lambda r: f"{r['model_state_vs_16_bytes_per_param']:.3f}"))
    print(table_row(f"ZeRO formula {unit}/GPU", results, lambda r: f"{r['zero_formula_bytes'] / gib:.3f}"))
    base = results.get("fsdp", {})
    print(table_row("tokens/s / fsdp", results, lambda r: f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.3f}"))
    print(table_row(f"peak - fsdp {unit}", results, lambda r: f"{(r['peak_bytes'] - base['peak_bytes']) / gib:+.2f}"))
    print(table_row("loss first -> last", results, lambda r: f"{r['losses'][0]:.3f}>{r['losses'][-1]:.3f}"))
    ref = next((r for r in results.values() if "error" not in r), None)
    if ref is not None:  # same seed, init and batches: the modes differ only by rounding
        print(table_row(f"max|loss - {ref['mode']}|", results,
                   lambda r: f"{max(abs(a - b) for a, b in zip(r['losses'], ref['losses'])):.2e}"))
    if any("profile" in r for r in results.values()):
        print_profile(results)
    for m, r in results.items():
        if "error" in r:
            print(f"{m}: FAILED {r['error']}")
    print(f"\ntargets (set for the 1.7b spec on 2 GPUs; this run: {args.spec}, {world} GPU(s)):")
    for line in targets(results):
        print("  " + line)


def print_profile(results: dict) -> None:
    print(f"profiled ({PROFILE_STEPS} steps, rank 0, per step; exposed = NCCL time with no compute kernel running)")
    ms = lambda key: lambda r: f"{1e3 * r['profile'][key]:.1f}"  # noqa: E731
    pct = lambda key: lambda r: f"{100 * r['profile'][key] / r['profile']['step_s']:.1f}"  # noqa: E731
    print(table_row("  step ms (under profiler)", results, ms("step_s")))
    print(table_row("  compute kernels ms", results, ms("compute_kernel_s")))
    print(table_row("  NCCL kernels ms", results, ms("nccl_kernel_s")))
    print(table_row("  NCCL exposed ms", results, ms("nccl_exposed_s")))
    print(table_row("  NCCL exposed % step", results, pct("nccl_exposed_s")))
    print(table_row("  memcpy/memset ms", results, ms("memcpy_s")))
    print(table_row("  GPU idle ms", results, ms("gpu_idle_s")))
    print(table_row("  GPU idle % step", results, pct("gpu_idle_s")))
    for m, r in results.items():
        prof = r.get("profile") or {}
        if "error" in prof:
            print(f"{m}: trace analysis failed: {prof['error']}")
        if "trace" not in prof:
            continue
        if not prof["num_activities"]:
            print(f"{m}: no GPU activity in the trace (a CPU run, or CUPTI traced no kernels); trace {prof['trace']}")
            continue
        print(f"{m}: top kernels (ms/step, calls in {prof['steps']} steps); trace {prof['trace']} "
              f"({prof['trace_bytes'] / 2**20:.1f} MiB)")
        for k in prof["top_kernels"]:
            print(f"  {1e3 * k['s_per_step']:9.2f} {k['calls']:6d}x {k['kind']:<8} {k['name'][:110]}")


def targets(results: dict) -> list[str]:
    ok = lambda m: m in results and "error" not in results[m]  # noqa: E731
    lines = []
    if ok("fsdp"):
        f = results["fsdp"]
        lines.append(f"FSDP MFU {100 * f['mfu']:.1f} %  (target >= 50 %)  {'PASS' if f['mfu'] >= 0.5 else 'MISS'}")
        ratio = f["model_state_vs_16_bytes_per_param"]
        lines.append(f"FSDP model state / (16 B/param / dp) = {ratio:.3f}  (target within 10 %)  "
                     f"{'PASS' if abs(ratio - 1) <= 0.10 else 'MISS'}")
        for other, goal in (("fsdp2", 1.05), ("ddp", 1.0)):
            if ok(other):
                x = f["tokens_per_s_per_gpu"] / results[other]["tokens_per_s_per_gpu"]
                lines.append(f"FSDP / {other.upper()} throughput {x:.3f}x  (target >= {goal}x)  "
                             f"{'PASS' if x >= goal else 'MISS'}")
        if ok("fsdp2"):
            a, b = f["peak_bytes"], results["fsdp2"]["peak_bytes"]
            lines.append(f"FSDP peak {a / 2**30:.2f} GiB vs FSDP2 {b / 2**30:.2f} GiB  (target FSDP <= FSDP2)  "
                         f"{'PASS' if a <= b else 'MISS'}")
    return lines


def save(results: dict, spec: GPTSpec, args, world: int) -> None:
    """The run as JSON at --out (rewritten after every mode, so a run cut short keeps what it measured)."""
    write_json(args.out, dict(args=vars(args), spec=vars(spec), params=spec.param_count(),
                              matmul_params=matmul_params(spec), flops_per_token=flops_per_token(spec),
                              peak_flops_per_gpu=PEAK_FLOPS_PER_GPU, world=world, results=results,
                              targets=targets(results)))


def main() -> None:
    on_gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="1.7b" if on_gpu else "tiny", choices=list(SPECS))
    add_engine_args(ap)
    add_step_args(ap)
    ap.add_argument("--modes", default="ddp,fsdp,fsdp2", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--profile", action="store_true",
                    help=f"profile {PROFILE_STEPS} extra steps of the --profile-modes; traces next to --out")
    ap.add_argument("--profile-modes", default="ddp,fsdp,fsdp2", help="modes --profile covers ('all': every mode)")
    ap.add_argument("--repeats", type=int, default=1, help="run every mode this many times, interleaved")
    ap.add_argument("--pipelined", action="store_true",
                    help="time a loop that starts each step before it reads the last one's loss (train.start_step) "
                         "instead of each step alone between two device syncs")
    ap.add_argument("--out", default="runs/bench/throughput.json")
    args = ap.parse_args()
    modes = parse_modes(ap, args.modes)
    args.profile_modes = modes if args.profile_modes == "all" else parse_modes(ap, args.profile_modes)
    spec = SPECS[args.spec]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args.global_batch = args.global_batch or args.micro_batch_size * world
    if args.global_batch % (args.micro_batch_size * world):
        ap.error(f"--global-batch {args.global_batch} must be a multiple of micro-batch * world = "
                 f"{args.micro_batch_size * world}")
    data = batches(spec, n=args.warmup + args.steps, global_batch=args.global_batch)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    rank = int(os.environ.get("RANK", "0"))   # the world is joined inside each run
    for i in range(args.repeats):
        for m in modes:   # the first round alone is profiled
            runs[m].append(run_mode(m, spec, data, args, profile=args.profile and i == 0 and m in args.profile_modes))
            results = {m: combine_runs(r, spec) for m, r in runs.items() if r}
            if rank == 0:
                save(results, spec, args, world)
    if rank == 0:
        print_report(results, spec, args, world)
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
