"""Real (non-padding) tokens/s, padded vs packed, on issue #38's two length mixes.

    torchrun --nproc_per_node 1 bench/packing.py --spec 1.7b --out runs/bench/packing.json
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 1 bench/packing.py --spec tiny --sequences 8 --steps 2 \\
        --warmup 1 --ways padded,packed-sdpa --mixes rl --max-tokens 32 --out /tmp/packing.json   # CPU

Per mix (`mfsdp_kit.perf.length_mix`: "sft" log-normal lengths, median 300, max --max-tokens; "rl" a
128-token prompt and a response uniform in [16, 1024]) every way trains on the same --sequences sequences a
step, padded to the mix's longest possible sequence S. Ways, all Megatron-FSDP (--wrapper), bf16, fused
RoPE/SwiGLU and cross-entropy (the kit's GPU settings):
- padded: micro-batches of --micro-batch-size rows of S positions (`packed=False`);
- packed-sdpa: micro-batches of at most --micro-batch-size x S tokens (`max_tokens_per_micro_batch`): never
  more positions than a padded micro-batch, so activation memory under the padded run's; varlen flash attention
  (`models.varlen`) on each row on a GPU;
- packed-flex: the same budget, one flex_attention per packed row over a document mask (attention_backend="flex").
A packed way may name its own budget in tokens, `packed-sdpa@11520`: packed rows hold no padding, so a budget
above the padded micro-batch's positions can still peak under the padded run's memory (the table shows both).
Reported per way: median step time (`train.step`: each step read before the next starts); real tokens/s
(tokens up to each sequence's last loss token, what both ways train on); positions/s (what the model computes);
micro-batches a step; peak memory; cudaMallocs per timed step (new allocator segments: packed shapes change every
forward); the largest relative loss difference from the padded way (the same numbers up to bf16 rounding); the
mean step time when the timed batches run again through `train.run_steps` (each step issued before the last is
read, as `rl.core.update` runs the policy update: a step's opening host work overlaps the last one's GPU work),
and its speed-up; and per mix the share of the padded positions that are padding. --keep-gathered: every way
with `wrapper.fsdp_keep_gathered`; --wrapper ddp: megatron DDP instead of Megatron-FSDP (what its hooks cost).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist

from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.train import packing
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.config.sections import Kernels, Wrapper
from mfsdp_kit.models.gpt import SPECS, gpt_model_fn
from mfsdp_kit.perf import length_mix, options
from mfsdp_kit.perf.report import write_json
from mfsdp_kit.train import StepOptions, local_micro_batches, run_steps, step

WAYS = {"padded": ("sdpa", False), "packed-sdpa": ("sdpa", True), "packed-flex": ("flex", True)}
"""way -> (attention_backend, packed)."""


def parse_way(way: str) -> tuple[str, bool, int | None] | None:
    """"packed-sdpa@11520" -> (attention_backend, packed, token budget or None); None if not a way."""
    name, at, tokens = way.partition("@")
    if name not in WAYS or (at and not (tokens.isdigit() and WAYS[name][1])):
        return None
    return (*WAYS[name], int(tokens) if at else None)


def mix_batches(mix: str, *, steps: int, sequences: int, max_tokens: int, vocab_size: int) -> list:
    """`steps` global batches of `mix`, each padded to the mix's longest possible sequence."""
    seq = max_tokens if mix == "sft" else min(max_tokens, 128 + 1024)
    return [length_mix.batch(length_mix.lengths(mix, sequences, seed=s, max_tokens=seq), seq_len_tokens=seq,
                             vocab_size=vocab_size, seed=s) for s in range(steps)]


def step_profile(run, *, trace: str | None = None) -> dict:
    """One more step under torch.profiler: the top host ops by their own time (ms), and from the trace's
    kernel intervals (`perf.timeline`) the device's busy and idle time in the step and its top kernels.
    `trace`: also keep the step's chrome trace there."""
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    from mfsdp_kit.perf.timeline import gpu_activities, read_trace, timeline_summary
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        run()
    wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = trace or os.path.join(tmp, "trace.json")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        prof.export_chrome_trace(path)
        timeline = timeline_summary(gpu_activities(read_trace(path)), wall_s=wall, steps=1, top=20)
    host = [dict(op=e.key[:80], calls=e.count, ms=e.self_cpu_time_total / 1e3)
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]]
    return dict(wall_s=wall, timeline=timeline, host=host)


def print_profile(name: str, prof: dict) -> None:
    t = prof["timeline"]
    print(f"-- {name}: step {prof['wall_s']:.3f} s under the profiler; device busy {t['gpu_busy_s']:.3f} s, "
          f"idle {t['gpu_idle_s']:.3f} s")
    print("   top kernels:     ms  calls  kernel")
    for k in t["top_kernels"]:
        print(f"   {k['s_per_step'] * 1e3:17.2f} {k['calls']:6d}  {k['name'][:90]}")
    print("   top host ops by own time:  ms  calls  op")
    for r in prof["host"]:
        print(f"   {r['ms']:10.2f} {r['calls']:6d}  {r['op']}")


def measure(way: str, batches: list, *, spec, dtype: str, base: StepOptions, warmup: int,
            wrapper: str = "fsdp", keep_gathered: bool = False, profile: bool = False,
            trace: str | None = None) -> dict:
    attention, packed, tokens = parse_way(way)
    fused = dtype != "fp32"   # the kit's GPU settings
    wrap = Wrapper(use_megatron_fsdp=wrapper == "fsdp", fsdp_keep_gathered=keep_gathered)
    cfg = EngineConfig(wrapper=wrap, dtype=dtype, seed=0,
                       kernels=Kernels(attention_backend=attention, fused_kernels=fused, fused_cross_entropy=fused))
    runtime.init(cfg)
    chunks = engine.build(cfg, gpt_model_fn(spec, cfg))
    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-5), cfg)
    seq = batches[0].tokens.shape[1]
    how = dataclasses.replace(base, packed=packed,   # the way's packing; a packed way's default: the padded positions
                              max_tokens_per_micro_batch=(tokens or base.micro_batch_size * seq) if packed else None)
    cuda = torch.cuda.is_available()
    losses, times = [], []
    mallocs = 0
    for i, b in enumerate(batches):
        if i == warmup and cuda:
            torch.cuda.reset_peak_memory_stats()
            mallocs = -torch.cuda.memory_stats()["num_device_alloc"]
        t0 = time.perf_counter()
        losses.append(step(chunks, opt, b, step_index=i, options=how).loss)   # .loss read: the step's GPU work done
        times.append(time.perf_counter() - t0)
    mallocs += torch.cuda.memory_stats()["num_device_alloc"] if cuda else 0
    # the same batches again, each step issued before the last is read (`run_steps`, as `rl.core.update` runs)
    t0 = time.perf_counter()
    piped = run_steps(chunks, opt, batches[warmup:], start_index=len(batches), options=how)
    piped_s = (time.perf_counter() - t0) / len(piped)
    forwards = len(local_micro_batches(chunks, batches[0], options=how))
    prof = (step_profile(lambda: step(chunks, opt, batches[-1], step_index=len(batches), options=how).loss,
                         trace=trace) if profile else None)
    engine.release(chunks)
    runtime.shutdown()
    step_s = statistics.median(times[warmup:])
    real = statistics.mean(length_mix.real_tokens(b) for b in batches)
    computed = real if packed else batches[0].tokens.numel()
    return dict(step_s=step_s, real_tokens_per_s=real / step_s, positions_per_s=computed / step_s,
                pipelined_step_s=piped_s, pipelined_real_tokens_per_s=real / piped_s,
                pipelined_losses=[r.loss for r in piped],
                micro_batches_per_rank=forwards, mallocs_per_step=mallocs / max(1, len(batches) - warmup),
                peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0, losses=losses, profile=prof)


def guarded(way: str, batches: list, **kwargs) -> dict:
    """`measure`, or {"error": ...} when the way fails (an OOM, a compile error): the next way still runs."""
    try:
        return measure(way, batches, **kwargs)
    except Exception as e:   # noqa: BLE001 (recorded, not hidden: the table and the JSON show it)
        if runtime.is_initialized():
            runtime.shutdown()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def table(results: dict) -> str:
    lines = [f"{'mix':<4} {'way':<18} {'step s':>7} {'real tok/s':>11} {'positions/s':>12} {'mbs':>4} "
             f"{'peak GiB':>8} {'mallocs':>7} {'x padded':>8} {'max rel |dloss|':>15} {'piped s':>7} {'x padded':>8}"]
    for mix, r in results.items():
        base = r["ways"].get("padded")
        base = base if base and "error" not in base else None
        for way, w in r["ways"].items():
            if "error" in w:
                lines.append(f"{mix:<4} {way:<18} FAILED {w['error']}")
                continue
            speedup = w["real_tokens_per_s"] / base["real_tokens_per_s"] if base else float("nan")
            piped = w["pipelined_real_tokens_per_s"] / base["pipelined_real_tokens_per_s"] if base else float("nan")
            gap = max(abs(a - b) / abs(b) for a, b in zip(w["losses"], base["losses"])) if base else float("nan")
            lines.append(f"{mix:<4} {way:<18} {w['step_s']:7.3f} {w['real_tokens_per_s']:11.0f} "
                         f"{w['positions_per_s']:12.0f} {w['micro_batches_per_rank']:4d} {w['peak_gib']:8.2f} "
                         f"{w['mallocs_per_step']:7.1f} "
                         f"{speedup:8.2f} {gap:15.2e} {w['pipelined_step_s']:7.3f} {piped:8.2f}")
        lines.append(f"{mix:<4} padding: {r['padding_fraction']:.1%} of the padded positions "
                     f"({r['real_tokens']:.0f} real tokens in {r['positions']} a step)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="1.7b", choices=sorted(SPECS))
    ap.add_argument("--mixes", default="sft,rl", help=f"comma-separated of {','.join(length_mix.MIXES)}")
    ap.add_argument("--ways", default=",".join(WAYS),
                    help=f"comma-separated of {','.join(WAYS)}; a packed way may add @TOKENS, its micro-batch budget")
    ap.add_argument("--sequences", type=int, default=64, help="sequences per global batch (a step)")
    options.add_options(ap, StepOptions, prefix="", defaults=dict(micro_batch_size=8),   # x S: a packed way's budget
                        skip=("packed", "max_tokens_per_micro_batch"))   # each way sets them (--ways)
    ap.add_argument("--max-tokens", type=int, default=2048, help="the longest sequence of a mix")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per way")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiles, allocator warm-up)")
    ap.add_argument("--wrapper", default="fsdp", choices=["fsdp", "ddp"],
                    help="Megatron-FSDP (the kit's) or megatron DDP: the same steps without FSDP's per-module hooks")
    ap.add_argument("--keep-gathered", action="store_true",
                    help="every way with wrapper.fsdp_keep_gathered (each FSDP unit gathered once a step)")
    ap.add_argument("--profile", action="store_true", help="profile one more step of each way and print its top ops")
    ap.add_argument("--trace-dir", default=None, help="with --profile: write each way's chrome trace here")
    ap.add_argument("--out", default="runs/bench/packing.json")
    args = ap.parse_args()
    ways = args.ways.split(",")
    if bad := [w for w in ways if parse_way(w) is None]:
        raise SystemExit(f"--ways: {bad} not allowed; allowed: {','.join(WAYS)}, a packed one with @TOKENS")
    runtime.init(EngineConfig())
    spec, results = SPECS[args.spec], {}
    for mix in args.mixes.split(","):
        batches = mix_batches(mix, steps=args.warmup + args.steps, sequences=args.sequences, max_tokens=args.max_tokens,
                              vocab_size=spec.vocab_size)
        real = statistics.mean(length_mix.real_tokens(b) for b in batches)
        results[mix] = dict(padding_fraction=statistics.mean(packing.padding_fraction(b) for b in batches),
                            real_tokens=real, positions=batches[0].tokens.numel(), ways={})
        for way in ways:
            results[mix]["ways"][way] = guarded(way, batches, spec=spec, dtype=args.dtype,
                                                base=options.build(StepOptions, args, prefix=""), warmup=args.warmup,
                                                wrapper=args.wrapper, keep_gathered=args.keep_gathered,
                                                profile=args.profile, trace=args.trace_dir and
                                                f"{args.trace_dir}/{mix}_{way}.json")
            if dist.get_rank() == 0:
                if results[mix]["ways"][way].get("profile"):
                    print_profile(f"{mix} {way}", results[mix]["ways"][way]["profile"])
                write_json(args.out, dict(spec=args.spec, world=dist.get_world_size(), args=vars(args), results=results))
    if dist.get_rank() == 0:
        print(f"spec {args.spec}, {dist.get_world_size()} rank(s), {args.sequences} sequences a step, "
              f"micro-batch {args.micro_batch_size} rows = the packed token budget")
        print(table(results))
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
