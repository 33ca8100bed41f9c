"""Weight sync into a rollout model: seconds and GB/s to copy every weight from the training
chunks (Megatron-FSDP shards, or DDP for comparison) into a Hugging Face model on the device,
by the planned path (`weights.plan`: views of the gathered buckets) and by the bridge path (today's
per-tensor conversion), next to the hardware's ceiling measured in the same run on the same ranks.

    torchrun --nproc_per_node 2 bench/sync.py --size l --out runs/bench/sync_l.json             # GPU, bf16, 1.7 B
    torchrun --nproc_per_node 2 bench/sync.py --shape qwen2.5-7b --out runs/bench/sync_7b.json  # GPU, 7.6 B
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/sync.py --size xs                      # CPU, fp32

Per mode, each rank holds megatron chunks and its own rollout model on its device (as a colocated RL
worker does), and `sync.load_into(planned=...)` writes the weights into it. The rollout model is
zeroed before each path's first sync (which also builds the plan: the warm-up) and checked after it:
- --size (`models.tiny`): the folder is loaded into the chunks (`models.hf.load`) and into the rollout
  (`from_pretrained`); the rollout is checked against the folder's tensors.
- --shape (a real size, `perf.hf_folder.SHAPES`): no weights on disk (a 7.6 B folder costs minutes to
  write and load, the sync itself 0.1 s). The folder holds the config and the tensor names only; the
  chunks are built from the bridge's provider, every tensor drawn at random (biases and norms too),
  then wrapped; the rollout is built from the config on the device; the rollout is checked against the bridge's export of those same chunks
  (`sync.export_hf_weights`, per-tensor conversion: the path the plan replaces).
GB/s = bytes written into the rollout model (its dtype) / seconds; median of --repeats.

Ceiling (what a sync cannot beat): the all-gather of one rank's shard of the model
(`all_gather_into_tensor`, shard = model bytes / world; GB/s counts the gathered output) and an
on-device `copy_` of the model's bytes. A sync does both: with the next unit's gather overlapping
this unit's copies its floor is about max(gather, copy), without overlap their sum.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import EngineConfig
from mfsdp_kit.distributed.introspect import torch_dtype
from mfsdp_kit.models import hf as hf_models
from mfsdp_kit.models.tiny import tiny
from mfsdp_kit.distributed import clock
from mfsdp_kit.perf.hf_folder import SHAPES, hf_config, write_folder
from mfsdp_kit.weights.sync import export_hf_weights, load_into
from mfsdp_kit.perf.report import write_json


def _max_diff(rollout, path: Path, dtype: torch.dtype) -> float:
    """max|rollout - folder| over the folder's tensors (read one at a time onto the rollout's device)."""
    from safetensors import safe_open
    named, worst = dict(rollout.named_parameters()), 0.0
    device = next(rollout.parameters()).device
    for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        with safe_open(str(path / file), framework="pt", device=str(device)) as f:
            for k in f.keys():
                if k in named:
                    want = f.get_tensor(k).to(dtype)
                    worst = max(worst, (named[k].float() - want.float()).abs().max().item())
    return worst


def _max_diff_vs_export(rollout, chunks, bridge) -> float:
    """max|rollout - the bridge's export of `chunks`| (collective under FSDP: every rank iterates)."""
    named, worst = dict(rollout.named_parameters()), 0.0
    for name, tensor in export_hf_weights(chunks, bridge, cpu=False):
        if name in named:
            worst = max(worst, (named[name].float() - tensor.to(named[name].device).float()).abs().max().item())
    return worst


def _timed(fn, repeats: int) -> tuple[list[float], object]:
    """(seconds of each call, barrier-aligned and device-synchronized; the last result)."""
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        took, out = clock.seconds(fn)
        seconds.append(took)
    return seconds, out


def _models(mode: str, path: Path, args):
    """(chunks, bridge, rollout) for one mode; see the module docstring for --size vs --shape."""
    from transformers import AutoModelForCausalLM
    cfg = EngineConfig(use_megatron_fsdp=mode == "fsdp", dtype=args.dtype)
    rt = runtime.init(cfg)
    dtype = torch_dtype(args.dtype)
    if args.shape is None:
        model = hf_models.load(path, cfg)
        rollout = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(rt.device).eval()
        return model.chunks, model.bridge, rollout
    bridge, provider = hf_models.provider(path, cfg)
    chunks = engine.build(cfg, provider, wrap=False)
    gen = torch.Generator(rt.device).manual_seed(0)
    with torch.no_grad():  # every tensor redrawn (megatron zeroes biases, sets norms to 1): each view shows
        for p in (p for c in chunks for p in c.parameters()):
            p.normal_(0, 0.02, generator=gen)
    chunks = engine.wrap_chunks(cfg, chunks)
    with torch.device(rt.device):
        rollout = AutoModelForCausalLM.from_config(hf_config(args.shape), dtype=dtype).eval()
    return chunks, bridge, rollout


def run_mode(mode: str, path: Path, args) -> list[dict]:
    chunks, bridge, rollout = _models(mode, path, args)
    dtype = torch_dtype(args.dtype)
    results = []
    for sync_path in [p.strip() for p in args.paths.split(",") if p.strip()]:
        with torch.no_grad():
            for p in rollout.parameters():
                p.zero_()
        planned = sync_path == "planned"
        seconds, info = _timed(lambda: load_into(rollout, chunks, bridge, planned=planned),
                               args.warmup + args.repeats)
        measured = seconds[args.warmup:]
        median_s = statistics.median(measured)
        reference = "folder" if args.shape is None else "export"
        diff = _max_diff(rollout, path, dtype) if args.shape is None else _max_diff_vs_export(rollout, chunks, bridge)
        results.append(dict(mode=mode, path=sync_path, wrapper=type(chunks[0]).__name__, seconds=seconds,
                            median_s=median_s, bytes=info["bytes"], tensors=info["tensors"],
                            planned_tensors=info["planned"], bridge_tensors=info["bridge"],
                            first_s=seconds[0], gb_per_s=info["bytes"] / median_s / 1e9,
                            reference=reference, max_abs_diff=diff))
    del chunks, bridge, rollout
    runtime.shutdown()
    _free()
    return results


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ceiling(nbytes: int, args) -> dict:
    """All-gather of one rank's shard (nbytes / world) and a copy_ of nbytes, on this world's device."""
    runtime.init(EngineConfig())
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype, world = torch_dtype(args.dtype), dist.get_world_size()
    shard = torch.ones(nbytes // dtype.itemsize // world, dtype=dtype, device=device)
    gathered = torch.empty(shard.numel() * world, dtype=dtype, device=device)
    gather_s, _ = _timed(lambda: dist.all_gather_into_tensor(gathered, shard), args.warmup + args.repeats)
    del shard
    src = gathered  # nbytes (rounded down to whole shards)
    dst = torch.empty_like(src)
    copy_s, _ = _timed(lambda: dst.copy_(src), args.warmup + args.repeats)
    out_bytes = gathered.numel() * gathered.element_size()
    del src, dst, gathered
    _free()
    g, c = statistics.median(gather_s[args.warmup:]), statistics.median(copy_s[args.warmup:])
    return dict(bytes=out_bytes, shard_bytes=out_bytes // world, all_gather_s=g, all_gather_gb_per_s=out_bytes / g / 1e9,
                copy_s=c, copy_gb_per_s=out_bytes / c / 1e9, floor_overlapped_s=max(g, c), floor_serial_s=g + c,
                backend=dist.get_backend())


def _floor(result: dict, ceil: dict) -> float:
    """FSDP must gather and copy (overlapped); DDP holds full weights and only copies."""
    return ceil["floor_overlapped_s"] if result["mode"] == "fsdp" else ceil["copy_s"]


def table(results: list[dict], ceil: dict, title: str) -> str:
    lines = [title, f"{'mode':<6}{'path':<9}{'wrapper':>26}{'tensors':>9}{'planned':>9}{'MB':>10}{'first s':>9}"
                    f"{'median s':>10}{'GB/s':>8}{'x floor':>8}{'max|diff|':>11}  vs"]
    for r in results:
        lines.append(f"{r['mode']:<6}{r['path']:<9}{r['wrapper']:>26}{r['tensors']:>9}{r['planned_tensors']:>9}"
                     f"{r['bytes'] / 1e6:>10.1f}{r['first_s']:>9.3f}{r['median_s']:>10.4f}{r['gb_per_s']:>8.2f}"
                     f"{r['median_s'] / _floor(r, ceil):>8.1f}{r['max_abs_diff']:>11.2e}  {r['reference']}")
    lines.append(f"ceiling ({ceil['backend']}): all-gather of a {ceil['shard_bytes'] / 1e6:.1f} MB shard per rank "
                 f"{ceil['all_gather_s']:.4f} s ({ceil['all_gather_gb_per_s']:.1f} GB/s out), copy_ of "
                 f"{ceil['bytes'] / 1e6:.1f} MB {ceil['copy_s']:.4f} s ({ceil['copy_gb_per_s']:.1f} GB/s); floor "
                 f"{ceil['floor_overlapped_s']:.4f} s overlapped, {ceil['floor_serial_s']:.4f} s serial")
    return "\n".join(lines)


def main() -> None:
    on_gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="m" if on_gpu else "xs", help="models.tiny size: xs | s | m | l (1.7 B)")
    ap.add_argument("--arch", default="qwen2", help="models.tiny arch: qwen2 | llama")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="instead of --size/--arch: a real size, random megatron weights (qwen2.5-7b: 7.6 B)")
    ap.add_argument("--dtype", default="bf16" if on_gpu else "fp32", choices=["bf16", "fp32"])
    ap.add_argument("--modes", default="fsdp,ddp")
    ap.add_argument("--paths", default="planned,bridge", help="planned (weights.plan) and/or bridge (per tensor)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--workdir", default="runs/bench/sync_models")
    ap.add_argument("--out", default="runs/bench/sync.json")
    args = ap.parse_args()
    runtime.init(EngineConfig())  # the world, so rank 0 can write the folder before the others read it
    name = args.shape or f"{args.arch}-{args.size}"
    path = Path(args.workdir) / name
    if dist.get_rank() == 0:
        if args.shape is None:
            tiny(path, arch=args.arch, size=args.size)
        else:  # config and tensor names, no weights: milliseconds
            write_folder(path, args.shape, shard_gb=4.0, weights=False)
    dist.barrier()
    results = [r for m in args.modes.split(",") if m.strip() for r in run_mode(m.strip(), path, args)]
    ceil = ceiling(max(r["bytes"] for r in results), args)
    if dist.get_rank() == 0:
        print("\n" + table(results, ceil, f"weight sync into a rollout {name} model ({args.dtype}), world "
                                          f"{dist.get_world_size()}, median of {args.repeats} (+{args.warmup} warm-up: "
                                          f"'first s', which builds the plan)"))
        write_json(args.out, dict(args=vars(args), world=dist.get_world_size(), results=results, ceiling=ceil))
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
