"""Where a notebook SFT step goes: 02_sft's recipe (32 sequences x 16 tokens per step, one micro-batch per rank,
the notebooks' model in fp32), timed and profiled per variant.

    torchrun --nproc_per_node 1 bench/sft_step.py --variants ddp-local,fsdp-local,ddp-sdpa,fsdp-sdpa

A variant is `<ddp|fsdp>-<local|sdpa>[-fused]`: the wrapper, `EngineConfig.kernels.attention_backend`, and
`fused_kernels`. At 512 tokens a step the GPU waits for the host (megatron's per-module Python and thousands
of kernel launches), so the table counts what the host issues: kernels, host<->device copies and syncs per
step, beside the step time and the GPU's busy time. Every variant trains from the same init on the same
batches; `max |loss - first variant|` says what a variant changes besides speed.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from mfsdp_kit.train import data
from mfsdp_kit.notebook import model as notebook_model
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.models.hf import load
from mfsdp_kit.train import step
from mfsdp_kit.perf.report import write_json

HOST_CALLS = {"copies": ("cudaMemcpyAsync", "cudaMemcpy"), "syncs": ("cudaStreamSynchronize", "cudaDeviceSynchronize")}


def parse_variant(name: str) -> dict:
    """`fsdp-sdpa-fused` -> EngineConfig overrides."""
    parts = name.split("-")
    if len(parts) not in (2, 3) or parts[0] not in ("ddp", "fsdp") or parts[1] not in ("local", "sdpa") \
            or parts[2:] not in ([], ["fused"]):
        raise SystemExit(f"--variants: {name!r} is not allowed; allowed: <ddp|fsdp>-<local|sdpa>[-fused]")
    return dict(use_megatron_fsdp=parts[0] == "fsdp", attention_backend=parts[1], fused_kernels=parts[2:] == ["fused"])


def profile_steps(run, *, steps: int) -> dict:
    """torch.profiler over `steps` steps: per-step kernel count and GPU busy time, host copies and syncs."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run()
    events = prof.events()
    # device events less the record_function ranges the profiler mirrors on the GPU (they span whole forwards)
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    busy = collections.Counter()
    for e in kernels:
        busy[e.name[:80]] += e.device_time / steps / 1e3
    out = dict(kernels_per_step=len(kernels) / steps, gpu_busy_ms_per_step=sum(busy.values()),
               top_kernels_ms_per_step=dict(busy.most_common(5)))
    for what, names in HOST_CALLS.items():
        out[f"{what}_per_step"] = sum(e.name in names for e in events) / steps
    return out


def measure(nbm, tok, overrides: dict, *, steps: int, warmup: int, profiled: int) -> dict:
    cfg = nbm.engine_config(dtype="fp32", seed=0, **overrides)   # fp32: 02_sft's parity check needs it
    runtime.init(cfg)
    model = load(nbm.path, cfg)
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=nbm.lr(3e-3), warmup_steps=10), cfg)
    batches = data.batches(data.ArithmeticTask(digits=1).train_pairs(90), tok, seq_len_tokens=16, global_batch=32,
                           seed=0)
    losses = []

    def run():
        losses.append(step(model.chunks, opt, next(batches), micro_batch_size=32 // dist.get_world_size()).loss)

    for _ in range(warmup):
        run()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run()   # ends in .item(): the step's time includes its GPU work
        times.append(time.perf_counter() - t0)
    res = dict(step_ms=statistics.median(times) * 1e3, **profile_steps(run, steps=profiled))
    res["losses"] = losses
    engine.release(model.chunks)
    del model, opt
    return res


def table(results: dict) -> str:
    first = next(iter(results.values()))["losses"]
    lines = [f"{'variant':<18} {'ms/step':>8} {'GPU busy ms':>11} {'kernels':>8} {'copies':>7} {'syncs':>6} "
             f"{'max|loss-first|':>16}"]
    for name, r in results.items():
        gap = max(abs(a - b) for a, b in zip(r["losses"], first))
        lines.append(f"{name:<18} {r['step_ms']:8.1f} {r['gpu_busy_ms_per_step']:11.1f} {r['kernels_per_step']:8.0f} "
                     f"{r['copies_per_step']:7.0f} {r['syncs_per_step']:6.0f} {gap:16.2e}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="ddp-local,fsdp-local,ddp-sdpa,fsdp-sdpa",
                    help="comma-separated <ddp|fsdp>-<local|sdpa>[-fused]")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (compiles, allocator warm-up)")
    ap.add_argument("--profile-steps", type=int, default=3, help="steps under torch.profiler, after the timed ones")
    ap.add_argument("--out", default="runs/bench/sft_step.json")
    args = ap.parse_args()
    variants = {v: parse_variant(v) for v in args.variants.split(",")}
    runtime.init(EngineConfig())
    nbm = notebook_model.prepare(workdir=f"/tmp/mfsdp_sft_step_{os.getpid()}")
    tok = AutoTokenizer.from_pretrained(nbm.path)
    results = {name: measure(nbm, tok, o, steps=args.steps, warmup=args.warmup, profiled=args.profile_steps)
               for name, o in variants.items()}
    if dist.get_rank() == 0:
        print(f"{nbm}; {dist.get_world_size()} rank(s)")
        print(table(results))
        write_json(args.out, dict(model=str(nbm), world=dist.get_world_size(), results=results))
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
