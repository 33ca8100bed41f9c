"""The largest GPT that trains on the GPUs of one node: Megatron-FSDP vs DDP + distributed optimizer.

    torchrun --nproc_per_node 2 bench/max_model.py --spec 7b --out runs/bench/max_model.json             # GPU
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/max_model.py --spec tiny --max-trials 1         # CPU

The model is the 7b spec of mfsdp_kit.models.gpt.SPECS (hidden 4096, ffn 11008, 32 heads, vocab 32768) at
seq 2048, micro-batch 1 per rank, bf16, SDPA, no recompute; only num_layers varies:
    per layer   4 * 4096^2 + 3 * 4096 * 11008 + 2 * 4096 = 202.4 M params
    fixed       2 * 32768 * 4096 (embedding + output layer) + 4096 = 268.4 M params
Model state per rank, Adam, bf16 compute, N ranks (memory.zero_formula_bytes):
    DDP + distributed optimizer (ZeRO-1): 2 weights + 2 grads + 12/N  = 10 B/param at N = 2 (2.02 GB/layer)
    Megatron-FSDP optim_grads_params:     16/N                        =  8 B/param at N = 2 (1.62 GB/layer)
so model state alone allows 1.25x the layers on 2 GPUs (2.75x on 8); activations (per layer, the
same in both modes) and FSDP's unsharded all-gather buffers shrink the gap.

Method (about 6 builds per mode, each one build + --steps full training steps):
1. calibrate: train --calib-layers (two small sizes); peak reserved bytes = fixed + per_layer * L.
   Two steps, not one: Adam allocates its moments in the first optimizer.step(), so only the
   second forward/backward runs with the whole model state resident.
2. cap: after the first trial (NCCL communicators exist by then), every rank's torch allocator
   gets the same limit, min over ranks of (free + reserved) - --margin-gib, through
   torch.cuda.set_per_process_memory_fraction. The ranks run the same allocations, so they hit
   the limit at the same one: a rank that OOMs ALONE would leave the others waiting in a
   collective. If a trial hangs anyway, a watchdog ends the job after --trial-timeout-s; --out
   holds every trial finished before it (it is rewritten after each).
3. predict L* = floor((cap - fixed) / per_layer), then verify: L* must train and L* + --layer-step
   must OOM; step up while it trains, down while it OOMs, --max-trials at most
   (mfsdp_kit.perf.capacity decides the sizes; this script runs the trials).
On CPU there is no device memory to measure: the calibration sizes and --max-trials larger ones
train, without OOM search.
"""
from __future__ import annotations

import argparse
import os
import threading
import time
import traceback
from dataclasses import replace

import torch
import torch.distributed as dist

from mfsdp_kit.distributed import runtime
from mfsdp_kit.distributed.memory import zero_formula_bytes
from mfsdp_kit.models.gpt import SPECS, GPTSpec
from mfsdp_kit.perf import capacity, options
from mfsdp_kit.perf.flops import layer_params
from mfsdp_kit.perf.peaks import free_memory
from mfsdp_kit.perf.trainers import batches, build_trainer, run_step
from mfsdp_kit.perf.variants import VARIANTS, add_engine_args, engine_config_from_args, parse_modes, trainer_of
from mfsdp_kit.perf.report import write_json
from mfsdp_kit.train import StepOptions


# ---- one trial: build + --steps full training steps -------------------------------------------
def _train(mode: str, spec: GPTSpec, args) -> list[float]:
    """Build `mode` at `spec` and run --steps steps; the model lives (and dies) in this frame."""
    cfg = engine_config_from_args(args, mode, spec)
    trainer = build_trainer(mode, cfg, spec, options=options.build(StepOptions, args, prefix=""))
    world = dist.get_world_size()
    data = batches(spec, n=args.steps, global_batch=args.micro_batch_size * args.micro_batches * world)
    losses = [run_step(trainer, b, i) for i, b in enumerate(data)]
    trainer.settle()
    return losses


def _hung(mode: str, layers: int, timeout_s: float, out: str) -> None:
    print(f"rank {dist.get_rank()}: {mode} with {layers} layers still running after {timeout_s:.0f} s - a rank "
          f"probably ran out of memory alone while the others wait in a collective; ending the job "
          f"(finished trials are in {out})", flush=True)
    os._exit(3)


def trial(mode: str, spec: GPTSpec, args, *, purpose: str) -> dict:
    """Train `spec` in `mode`; every rank gets the same verdict (OOM on any rank = OOM)."""
    free_memory()
    watchdog = threading.Timer(args.trial_timeout_s, _hung, (mode, spec.num_layers, args.trial_timeout_s, args.out))
    watchdog.daemon = True
    watchdog.start()
    start, error, oom = time.perf_counter(), None, False
    try:
        losses = _train(mode, spec, args)
    except torch.OutOfMemoryError as e:
        error, oom, losses = f"OOM: {str(e).splitlines()[0][:300]}", True, []
    except Exception as e:  # noqa: BLE001 - recorded; ends this mode's search
        error, losses = f"{type(e).__name__}: {str(e)[:300]}", []
        if dist.get_rank() == 0:
            traceback.print_exc()
    finally:
        watchdog.cancel()
    seconds = time.perf_counter() - start
    on_gpu = torch.cuda.is_available()
    peaks = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()] if on_gpu else [0, 0]
    free_memory()
    flags = torch.tensor([int(error is None), int(oom), *peaks], dtype=torch.int64,
                         device="cuda" if on_gpu else "cpu")
    ok_and_rest = flags.clone()
    dist.all_reduce(ok_and_rest, op=dist.ReduceOp.MIN)  # trained on every rank?
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # OOM on any rank? the largest peaks
    trained, oom = bool(ok_and_rest[0]), bool(flags[1])
    if not trained and error is None:
        error = "OOM on another rank" if oom else "failed on another rank"
    return dict(mode=mode, layers=spec.num_layers, params=spec.param_count(), purpose=purpose,
                trained=trained, oom=oom, error=error,
                peak_allocated_bytes=int(flags[2]), peak_reserved_bytes=int(flags[3]), seconds=seconds,
                losses=losses)


# ---- the search -------------------------------------------------------------------------------
def set_cap(margin_bytes: int) -> dict:
    """The same torch allocator limit on every rank: min over ranks of (free + reserved) - margin."""
    free, total = torch.cuda.mem_get_info()
    usable = torch.tensor([free + torch.cuda.memory_reserved() - margin_bytes], dtype=torch.int64, device="cuda")
    dist.all_reduce(usable, op=dist.ReduceOp.MIN)
    cap = int(usable.item())
    torch.cuda.set_per_process_memory_fraction(cap / total)
    return dict(cap_bytes=cap, total_bytes=total, margin_bytes=margin_bytes,
                outside_torch_bytes=total - free - torch.cuda.memory_reserved())


def search_mode(mode: str, base: GPTSpec, args, state: dict, record) -> dict:
    """Calibrate, predict, verify one mode (capacity.search); `record(trial)` saves each finished trial.
    The allocator cap is set once, after the first trial of the first mode (state["cap"])."""
    on_gpu = torch.cuda.is_available()

    def run(layers: int, purpose: str) -> dict:
        t = trial(mode, replace(base, num_layers=layers), args, purpose=purpose)
        record(t)
        if on_gpu and "cap" not in state:  # communicators exist now: measure what is left
            state["cap"] = set_cap(int(args.margin_gib * 2**30))
        return t

    cap = (lambda: state["cap"]["cap_bytes"]) if on_gpu else None
    summary = capacity.search(run, base, calib_layers=args.calib_layers, layer_step=args.layer_step,
                              max_trials=args.max_trials, cap_bytes=cap)
    return dict(mode=mode, **summary)


# ---- report ---------------------------------------------------------------------------------
def print_trials(trials: list[dict]) -> None:
    print(f"{'mode':<16}{'layers':>7}{'params M':>12}{'peak alloc GiB':>16}{'peak resv GiB':>15}{'s':>7}  result")
    for t in trials:
        verdict = "OK" if t["trained"] else ("OOM" if t["oom"] else f"ERROR {t['error']}")
        print(f"{t['mode']:<16}{t['layers']:>7}{t['params'] / 1e6:>12,.1f}{t['peak_allocated_bytes'] / 2**30:>16.2f}"
              f"{t['peak_reserved_bytes'] / 2**30:>15.2f}{t['seconds']:>7.1f}  {verdict} ({t['purpose']})")


def print_summary(summaries: dict, base: GPTSpec, state: dict, args, world: int) -> None:
    per_layer = layer_params(base)
    if "cap" in state:
        c = state["cap"]
        print(f"torch allocator cap {c['cap_bytes'] / 2**30:.2f} GiB of {c['total_bytes'] / 2**30:.2f} GiB per GPU "
              f"(outside torch {c['outside_torch_bytes'] / 2**30:.2f} GiB, margin {c['margin_bytes'] / 2**30:.2f} GiB)")
    for mode, s in summaries.items():
        fsdp = trainer_of(mode) != "ddp"
        formula = zero_formula_bytes(num_params=per_layer, dp_size=world, fsdp=fsdp, dtype=args.dtype)
        line = f"{mode}: model state {formula / 2**30:.3f} GiB/layer by the ZeRO formula"
        if "per_layer_bytes" in s:
            line += (f"; measured peak {s['per_layer_bytes'] / 2**30:.3f} GiB/layer "
                     f"+ {s['fixed_bytes'] / 2**30:.2f} GiB, predicted {s['predicted_layers']} layers")
        if s.get("largest_trained_layers") is not None:
            line += (f"; largest trained {s['largest_trained_layers']} layers = "
                     f"{s['largest_trained_params'] / 1e6:,.1f} M params")
        if s.get("smallest_oom_layers") is not None:
            line += f", OOM at {s['smallest_oom_layers']}"
        if "error" in s:
            line += f"; ERROR {s['error']}"
        print(line)
    ratio = capacity.params_ratio(summaries)
    if ratio is not None:
        print(f"largest trainable model, Megatron-FSDP / DDP: {ratio:.3f}x params")


def main() -> None:
    on_gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="7b" if on_gpu else "tiny", choices=list(SPECS),
                    help="width of the model; its num_layers is ignored")
    add_engine_args(ap)
    ap.add_argument("--modes", default="ddp,fsdp", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    options.add_options(ap, StepOptions, prefix="", defaults=dict(micro_batch_size=1))
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="micro-batches per step (gradient accumulation: the grads then live through later forwards)")
    ap.add_argument("--steps", type=int, default=2, help="training steps per trial (2: see the docstring)")
    ap.add_argument("--calib-layers", default="8,16" if on_gpu else "2,4")
    ap.add_argument("--layer-step", type=int, default=2, help="layers between the last OK and the first OOM")
    ap.add_argument("--max-trials", type=int, default=4, help="trials per mode after the calibration")
    ap.add_argument("--margin-gib", type=float, default=2.0,
                    help="device memory kept outside the torch cap (NCCL communicators of later modes, ...)")
    ap.add_argument("--trial-timeout-s", type=float, default=180.0,
                    help="a trial running longer ends the job (a rank that OOMed alone leaves the others hanging)")
    ap.add_argument("--out", default="runs/bench/max_model.json")
    args = ap.parse_args()
    modes = parse_modes(ap, args.modes)
    args.calib_layers = sorted({int(x) for x in args.calib_layers.split(",")})
    if len(args.calib_layers) < 2:
        ap.error("--calib-layers needs two distinct sizes")
    base = SPECS[args.spec]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    state, all_trials, summaries = {}, [], {}

    def save() -> None:
        if rank != 0:
            return
        write_json(args.out, dict(args=vars(args), spec=vars(base), world=world, cap=state.get("cap"), trials=all_trials,
                                  summaries=summaries, fsdp_over_ddp_params=capacity.params_ratio(summaries)))

    def record(t: dict) -> None:
        all_trials.append(t)
        save()
        if rank == 0:
            print(f"[{t['mode']}] {t['layers']} layers ({t['params'] / 1e6:,.1f} M params): "
                  f"{'OK' if t['trained'] else 'OOM' if t['oom'] else 'ERROR'} "
                  f"peak reserved {t['peak_reserved_bytes'] / 2**30:.2f} GiB, {t['seconds']:.1f} s", flush=True)

    for mode in modes:
        runtime.init(engine_config_from_args(args, mode, base), timeout_s=args.timeout_s)
        summaries[mode] = search_mode(mode, base, args, state, record)
        save()
        runtime.shutdown()
    if rank == 0:
        print(f"\n{args.spec} width (H={base.hidden_size}, ffn={base.ffn_hidden_size}, V={base.vocab_size}), "
              f"seq {base.seq_len_tokens}, micro-batch {args.micro_batch_size}/rank x {args.micro_batches}, {args.dtype}, "
              f"attention={args.attention}, {world} ranks, {args.steps} steps per trial")
        print_trials(all_trials)
        print_summary(summaries, base, state, args, world)
    if on_gpu:
        torch.cuda.set_per_process_memory_fraction(1.0)
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
