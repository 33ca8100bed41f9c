"""DDP vs Megatron-FSDP on the same seed and data: per-step losses, memory per rank, step time.

    torchrun --nproc_per_node 2 bench/parity.py --dtype bf16 --out runs/bench/parity.json

Runs both wrappers one after the other in the same processes (re-initialising the world in
between), prints a table on rank 0 and writes JSON. On CPU it runs the tiny model on gloo.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.train.data import random_token_batches
from mfsdp_kit.distributed.memory import format_table, memory_report, zero_formula_bytes
from mfsdp_kit.models import GPTSpec, gpt_model_fn
from mfsdp_kit.train import Batch, StepOptions, step
from mfsdp_kit.perf import options
from mfsdp_kit.perf.report import write_json

GPU_SPEC = GPTSpec(num_layers=12, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                   ffn_hidden_size=2816, vocab_size=32768, seq_len_tokens=1024)
CPU_SPEC = GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=128,
                   seq_len_tokens=32)


def batches(spec: GPTSpec, *, steps: int, global_batch: int, seed: int = 0) -> list[Batch]:
    return random_token_batches(steps=steps, global_batch=global_batch, seq_len_tokens=spec.seq_len_tokens,
                                vocab_size=spec.vocab_size, seed=seed)


def run(*, fsdp: bool, spec: GPTSpec, dtype: str, steps: int, how: StepOptions, global_batch: int,
        attention_backend: str = "local") -> dict:
    cfg = EngineConfig(use_megatron_fsdp=fsdp, dtype=dtype, seed=11, attention_backend=attention_backend)
    rt = runtime.init(cfg)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    chunks = engine.build(cfg, gpt_model_fn(spec, cfg))
    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-4), cfg)
    after_wrap = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    losses, times = [], []
    for i, b in enumerate(batches(spec, steps=steps, global_batch=global_batch)):
        r = step(chunks, opt, b, options=how, step_index=i)
        losses.append(r.loss)
        times.append(r.step_time_s)
    report = memory_report(chunks, opt)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    per_rank = [None] * rt.world_size
    dist.all_gather_object(per_rank, dict(peak_bytes=peak, after_wrap_bytes=after_wrap, **report.as_dict()))
    tokens = global_batch * spec.seq_len_tokens
    result = dict(wrapper=type(chunks[0]).__name__, losses=losses, step_time_s_median=statistics.median(times[1:] or times),
                  tokens_per_s_per_gpu=tokens / statistics.median(times[1:] or times) / rt.world_size,
                  per_rank=per_rank, report=report,
                  zero_formula_bytes=zero_formula_bytes(num_params=report.num_params, dp_size=rt.dp_size,
                                                        fsdp=fsdp, dtype=dtype))
    del chunks, opt
    runtime.shutdown()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16" if torch.cuda.is_available() else "fp32")
    ap.add_argument("--steps", type=int, default=8)
    options.add_options(ap, StepOptions, prefix="", defaults=dict(micro_batch_size=2))
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--attention", default="local")
    ap.add_argument("--out", default="runs/bench/parity.json")
    args = ap.parse_args()
    spec = GPU_SPEC if torch.cuda.is_available() else CPU_SPEC
    kw = dict(spec=spec, dtype=args.dtype, steps=args.steps, how=options.build(StepOptions, args, prefix=""),
              global_batch=args.global_batch, attention_backend=args.attention)
    ddp, fsdp = run(fsdp=False, **kw), run(fsdp=True, **kw)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print(f"\nDDP vs Megatron-FSDP, {spec.param_count() / 1e6:.1f} M params, {args.dtype}, "
          f"world {len(ddp['per_rank'])}, global batch {args.global_batch} x {spec.seq_len_tokens} tokens")
    print(f"{'step':>4} {'DDP loss':>12} {'FSDP loss':>12} {'rel diff':>10}")
    for i, (a, b) in enumerate(zip(ddp["losses"], fsdp["losses"])):
        print(f"{i:>4} {a:>12.6f} {b:>12.6f} {abs(a - b) / abs(a):>10.2e}")
    print(f"{'':>4} {'DDP':>12} {'FSDP':>12}")
    print(f"{'step time s (median)':<22}{ddp['step_time_s_median']:>8.4f} {fsdp['step_time_s_median']:>12.4f}")
    print(f"{'tokens/s/GPU':<22}{ddp['tokens_per_s_per_gpu']:>8.0f} {fsdp['tokens_per_s_per_gpu']:>12.0f}")
    for r in range(len(ddp["per_rank"])):
        d, f = ddp["per_rank"][r], fsdp["per_rank"][r]
        print(f"rank {r}: peak GiB {d['peak_bytes'] / 2**30:.2f} vs {f['peak_bytes'] / 2**30:.2f}; "
              f"model state GiB {d['model_state_bytes'] / 2**30:.3f} vs {f['model_state_bytes'] / 2**30:.3f}")
    print(format_table({"DDP": ddp.pop("report"), "FSDP": fsdp.pop("report")}, dtype=args.dtype))
    write_json(args.out, dict(args=vars(args), params=spec.param_count(), ddp=ddp, fsdp=fsdp))


if __name__ == "__main__":
    main()
