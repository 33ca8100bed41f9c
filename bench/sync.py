"""Weight sync into a rollout model: seconds and GB/s to copy every weight from the training
chunks (Megatron-FSDP shards, or DDP for comparison) into a Hugging Face model on the device.

    torchrun --nproc_per_node 2 bench/sync.py --size m --out runs/bench/sync.json            # GPU, bf16
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/sync.py --size xs                   # CPU, fp32

Per mode: a tiny HF folder (`models.tiny`) is loaded into megatron chunks (`models.hf.load`),
each rank holds its own rollout model (`AutoModelForCausalLM.from_pretrained` on its device,
as a colocated RL worker does), and `sync.load_into` streams the weights into it: for FSDP
each unit is all-gathered, converted to HF names and copied, then released. The rollout model
is zeroed before the first sync and checked against the folder's weights after it.
GB/s = bytes written into the rollout model (its dtype) / seconds; median of --repeats.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mfsdp_kit import runtime
from mfsdp_kit.config import EngineConfig
from mfsdp_kit.introspect import torch_dtype
from mfsdp_kit.models import hf as hf_models
from mfsdp_kit.models.tiny import tiny
from mfsdp_kit.sync import load_into


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_mode(mode: str, path: Path, args) -> dict:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    cfg = EngineConfig(use_megatron_fsdp=mode == "fsdp", dtype=args.dtype)
    rt = runtime.init(cfg)
    model = hf_models.load(path, cfg)
    dtype = torch_dtype(args.dtype)
    rollout = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(rt.device).eval()
    with torch.no_grad():
        for p in rollout.parameters():
            p.zero_()
    seconds, info = [], {}
    for _ in range(args.warmup + args.repeats):
        dist.barrier()
        _sync()
        t0 = time.perf_counter()
        info = load_into(rollout, model.chunks, model.bridge)
        _sync()
        seconds.append(time.perf_counter() - t0)
    expected = load_file(str(path / "model.safetensors"))
    named = dict(rollout.named_parameters())
    max_diff = max((named[k].float().cpu() - v.to(dtype).float()).abs().max().item()
                   for k, v in expected.items() if k in named)
    measured = seconds[args.warmup:]
    median_s = statistics.median(measured)
    result = dict(mode=mode, wrapper=type(model.chunks[0]).__name__, seconds=seconds, median_s=median_s,
                  bytes=info["bytes"], tensors=info["tensors"], gb_per_s=info["bytes"] / median_s / 1e9,
                  max_abs_diff_vs_folder=max_diff)
    del model, rollout
    runtime.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    on_gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="m" if on_gpu else "xs", help="models.tiny size: xs | s | m | l (1.7 B)")
    ap.add_argument("--arch", default="qwen2", help="models.tiny arch: qwen2 | llama")
    ap.add_argument("--dtype", default="bf16" if on_gpu else "fp32", choices=["bf16", "fp32"])
    ap.add_argument("--modes", default="fsdp,ddp")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--workdir", default="runs/bench/sync_models")
    ap.add_argument("--out", default="runs/bench/sync.json")
    args = ap.parse_args()
    runtime.init(EngineConfig())  # the world, so rank 0 can write the folder before the others read it
    path = Path(args.workdir) / f"{args.arch}-{args.size}"
    if dist.get_rank() == 0:
        tiny(path, arch=args.arch, size=args.size)
    dist.barrier()
    results = [run_mode(m.strip(), path, args) for m in args.modes.split(",") if m.strip()]
    if dist.get_rank() == 0:
        print(f"\nweight sync into a rollout {args.arch}-{args.size} model ({args.dtype}), world "
              f"{dist.get_world_size()}, median of {args.repeats} (+{args.warmup} warm-up)")
        print(f"{'mode':<6}{'wrapper':>26}{'tensors':>9}{'MB':>10}{'median s':>10}{'GB/s':>8}{'max|diff|':>11}")
        for r in results:
            print(f"{r['mode']:<6}{r['wrapper']:>26}{r['tensors']:>9}{r['bytes'] / 1e6:>10.1f}{r['median_s']:>10.4f}"
                  f"{r['gb_per_s']:>8.3f}{r['max_abs_diff_vs_folder']:>11.2e}")
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), world=dist.get_world_size(), results=results), f, indent=1)
        print("wrote", args.out)
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
