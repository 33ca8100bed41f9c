"""MoE throughput and memory per GPU: megatron DDP vs Megatron-FSDP at expert-parallel size 1 vs 2.

    torchrun --nproc_per_node 2 bench/moe_throughput.py --spec moe-1.3b --micro-batch-size 4 \\
        --global-batch 16 --steps 8 --warmup 2 --out runs/bench/moe_throughput.json
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/moe_throughput.py --spec moe-tiny --steps 2   # CPU

Every run trains the SAME megatron MoE GPT (models.gpt MOE_SPECS, SequentialMLP experts, all-to-all
token dispatch, no auxiliary loss; same seed and batches) in the same processes, one after another:
- ddp  x EP e: megatron DDP + distributed optimizer; dense grads all-reduced over all ranks, expert
               grads over the expert-data-parallel ranks (world / e);
- fsdp x EP e: Megatron-FSDP optim_grads_params (ZeRO-3); dense params sharded over all ranks, each
               expert over the world / e ranks holding it.
At EP 1 every rank runs every expert on its own tokens; at EP 2 each rank holds half the experts
and tokens travel to them and back by two all-to-alls per MoE layer. The expert weights are drawn
from megatron's expert-parallel RNG, which differs by EP size: losses compare within one EP size.

FLOPs per token count the ACTIVE parameters (topk experts, not all of them; input embedding excluded):
    6 * N_active  +  12 * L * H * S;   MFU = tokens/s/GPU * FLOPs per token / 989e12 (H100/H200 bf16).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

import torch
import torch.distributed as dist

from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import OptimConfig
from mfsdp_kit.models.gpt import MOE_SPECS, GPTSpec, gpt_model_fn
from mfsdp_kit.distributed import clock
from mfsdp_kit.perf import options
from mfsdp_kit.perf.flops import PEAK_FLOPS_PER_GPU
from mfsdp_kit.perf.peaks import PhasePeaks, guarded_run, record_step_phases
from mfsdp_kit.perf.trainers import batches
from mfsdp_kit.perf.variants import add_engine_args, add_step_args, engine_config_from_args
from mfsdp_kit.train import StepOptions, step
from mfsdp_kit.perf.report import table_row, units, write_json

MODES = ("ddp", "fsdp")


def flops_per_token(spec: GPTSpec) -> float:
    """6 * active parameters (input embedding excluded) + attention's 12 * L * H * S."""
    active = spec.active_param_count() - spec.vocab_size * spec.hidden_size
    return 6 * active + 12 * spec.num_layers * spec.hidden_size * spec.seq_len_tokens


def _train(cfg, spec: GPTSpec, data, args, peaks: PhasePeaks) -> dict:
    """Build, time every step of `data`; the model lives in this frame only (freed on return)."""
    chunks = engine.build(cfg, gpt_model_fn(spec, cfg))
    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-4, clip_grad=1.0), cfg)
    record_step_phases(opt, peaks)
    times, losses, how = [], [], options.build(StepOptions, args, prefix="")
    for i, b in enumerate(data):
        with clock.timed() as t:
            losses.append(step(chunks, opt, b, options=how, step_index=i).loss)
        times.append(t.seconds)
    engine.synchronize_fsdp_params(chunks)  # waits for and drops pending all-gathers
    local_params = engine.local_numel(chunks)
    engine.release(chunks)
    return dict(times=times, losses=losses, local_params=local_params)


def run(mode: str, ep: int, spec: GPTSpec, data, args) -> dict:
    cfg = engine_config_from_args(args, mode, spec)
    cfg = dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, expert_model_parallel_size=ep))
    result, error, peaks, rt = guarded_run(cfg, lambda peaks: _train(cfg, spec, data, args, peaks),
                                           timeout_s=args.timeout_s)
    peak = peaks.overall()
    base = dict(mode=mode, ep=ep, peak_bytes=peak, phase_peak_bytes=dict(peaks.peaks), config=cfg.to_dict())
    if error is not None:
        return dict(base, error=error)
    step_s = statistics.median(result["times"][args.warmup:] or result["times"])
    tokens_per_s_gpu = len(data[0].tokens) * spec.seq_len_tokens / step_s / rt.world_size
    return dict(base, step_s=step_s, step_times_s=result["times"], losses=result["losses"],
                tokens_per_s_per_gpu=tokens_per_s_gpu,
                mfu=tokens_per_s_gpu * flops_per_token(spec) / PEAK_FLOPS_PER_GPU,
                local_params=result["local_params"])


# ---- report --------------------------------------------------------------------------------
def print_report(results: dict, spec: GPTSpec, args, world: int) -> None:
    gib, unit, scale, pu = units(spec.param_count())
    print(f"\n{args.spec}: {spec.param_count() / scale:.3f} {pu} params, {spec.active_param_count() / scale:.3f} {pu} "
          f"active per token ({spec.num_experts} experts, top-{spec.moe_router_topk}), L={spec.num_layers} "
          f"H={spec.hidden_size} S={spec.seq_len_tokens}, {args.dtype}, attention={args.attention}, world={world}, "
          f"micro-batch {args.micro_batch_size}, global batch {args.global_batch} x {spec.seq_len_tokens} tokens")
    print(f"FLOPs/token = 6*N_active + 12*L*H*S = {flops_per_token(spec) / 1e9:.3f} GFLOP; "
          f"MFU peak {PEAK_FLOPS_PER_GPU / 1e12:.0f} TFLOP/s/GPU")
    row = lambda name, fmt: table_row(name, results, fmt, name_width=26, width=14)  # noqa: E731
    print(f"{'':<26}" + "".join(f"{k:>14}" for k in results))
    print(row("step s (median)", lambda r: f"{r['step_s']:.4f}"))
    print(row("tokens/s/GPU", lambda r: f"{r['tokens_per_s_per_gpu']:,.0f}"))
    print(row("MFU % (active params)", lambda r: f"{100 * r['mfu']:.1f}"))
    print(row(f"peak {unit}/GPU", lambda r: f"{r['peak_bytes'] / gib:.2f}"))
    for phase in ("forward_backward", "optimizer_step"):
        print(row(f"  peak in {phase}", lambda r: f"{r['phase_peak_bytes'][phase] / gib:.2f}"))
    print(row(f"params on rank 0 ({pu})", lambda r: f"{r['local_params'] / scale:.3f}"))
    print(row("loss first -> last", lambda r: f"{r['losses'][0]:.3f}>{r['losses'][-1]:.3f}"))
    # Same seed and batches; one EP size draws its experts' init from the same RNG streams, another does
    # not (megatron's expert-parallel RNG): losses compare within one EP size, to the first run there.
    refs = {}
    for r in results.values():
        if "error" not in r:
            refs.setdefault(r["ep"], r)
    gap = lambda r: max(abs(a - b) for a, b in zip(r["losses"], refs[r["ep"]]["losses"]))  # noqa: E731
    print(row("max|loss - same-EP first|", lambda r: f"{gap(r):.2e}"))
    for k, r in results.items():
        if "error" in r:
            print(f"{k}: FAILED {r['error']}")


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    on_gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="moe-1.3b" if on_gpu else "moe-tiny", choices=list(MOE_SPECS))
    add_engine_args(ap)
    add_step_args(ap)
    ap.add_argument("--modes", default="ddp,fsdp", help="comma-separated, of: ddp, fsdp")
    ap.add_argument("--ep", default="1,2", help="comma-separated expert-parallel sizes")
    ap.add_argument("--out", default="runs/bench/moe_throughput.json")
    args = ap.parse_args()
    spec, world = MOE_SPECS[args.spec], int(os.environ.get("WORLD_SIZE", "1"))
    modes, eps = [m for m in args.modes.split(",") if m], _int_list(args.ep)
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes {args.modes!r}: allowed: a comma-separated list of {', '.join(MODES)}")
    if not eps or any(e < 1 or world % e or spec.num_experts % e for e in eps):
        ap.error(f"--ep {args.ep!r}: each size must be >= 1 and divide the world ({world}) and the spec's "
                 f"{spec.num_experts} experts")
    args.global_batch = args.global_batch or args.micro_batch_size * world
    if args.global_batch % (args.micro_batch_size * world):
        ap.error(f"--global-batch {args.global_batch} must be a multiple of micro-batch * world = "
                 f"{args.micro_batch_size * world}")
    data = batches(spec, n=args.warmup + args.steps, global_batch=args.global_batch)
    results = {f"{m}-ep{e}": run(m, e, spec, data, args) for e in eps for m in modes}
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        print_report(results, spec, args, world)
        write_json(args.out, dict(args=vars(args), spec=vars(spec), params=spec.param_count(),
                                  active_params=spec.active_param_count(), flops_per_token=flops_per_token(spec),
                                  peak_flops_per_gpu=PEAK_FLOPS_PER_GPU, world=world, results=results))
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
