"""Checkpoint save / load throughput and size for a GPTSpec, DDP or Megatron-FSDP.

    torchrun --nproc_per_node 2 bench/checkpoint.py --fsdp --layers 2 --hidden 64 --out runs/bench/ckpt.json

Builds the model, takes one optimizer step (so Adam state exists), then saves and loads
`--repeats` times into `--root` (a fresh step each time) and reports the median seconds and
GB/s (checkpoint bytes / seconds; 1 GB = 1e9 bytes), and the median of each phase of rank 0's
saves and loads (CheckpointManager.last_save_phases_s / last_load_phases_s: what each is). The
top-level phases add up to rank 0's save (load); `write.data` is a part of `write`; "per file":
a writer thread's mean seconds per file. keep_last=1, so from the third save on each save prunes
the step before the last (renamed away in the commit, deleted in the background meanwhile).
Rank 0 prints a table and writes JSON (with every repeat's phases).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mfsdp_kit import checkpoint as ckpt
from mfsdp_kit.checkpoint import collective, storage
from mfsdp_kit.checkpoint.manager import TENSOR_FORMATS
from mfsdp_kit.distributed import engine, introspect, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.models import GPTSpec, gpt_model_fn
from mfsdp_kit.train import Batch, step
from mfsdp_kit.perf.report import write_json


def disk_write_gb_per_s(root: Path, nbytes: int) -> float:
    """All ranks at once each write `nbytes` to their own file under `root` and fsync: the disk's
    ceiling for a save (GB/s summed over ranks)."""
    buf = torch.empty(nbytes, dtype=torch.uint8).numpy()
    path = root / f".probe-{dist.get_rank()}"
    dist.barrier()
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(buf.data)
        f.flush()
        os.fsync(f.fileno())
    dist.barrier()
    seconds = time.perf_counter() - t0
    path.unlink()
    return nbytes * dist.get_world_size() / seconds / 1e9


def phase_rows(phases: dict) -> list:
    """Table rows: the top-level phases (they add up to the save / load), then each one's parts."""
    top = {k: v for k, v in phases.items() if "." not in k and k not in storage.PER_FILE}
    rows = [("  phases", "  ".join(f"{k} {v:.3f}" for k, v in top.items()) + f"  (sum {sum(top.values()):.3f} s)")]
    for name in top:
        parts = {k.split(".", 1)[1]: v for k, v in phases.items() if k.startswith(name + ".")}
        if parts:
            rows.append((f"    {name}", "  ".join(f"{k} {v:.3f}" for k, v in parts.items())))
    if any(k in phases for k in storage.PER_FILE):
        rows.append(("    per file", "  ".join(f"{k} {phases[k]:.3f}" for k in storage.PER_FILE if k in phases)))
    return rows


def optimizer_tensors(opt) -> list[torch.Tensor]:
    """Every inner torch optimizer's params (the fp32 main weights) and their Adam state: what a load must bring
    back, in a fixed order."""
    out = []
    for inner in introspect.inner_optimizers(opt):
        torch_opt = inner.optimizer
        for group in torch_opt.param_groups:
            for p in group["params"]:
                out += [p, *(v for v in torch_opt.state.get(p, {}).values() if torch.is_tensor(v))]
    return [introspect.local(t) for t in out]   # this rank's shard of a DTensor (Megatron-FSDP's main weights)


def round_trip_is_bitwise(mgr, chunks, opt, *, step_no: int) -> bool:
    """Save, scribble over the optimizer's tensors (+1), load: every tensor equal to before, bit for bit (all ranks)."""
    before = [t.detach().clone() for t in optimizer_tensors(opt)]
    mgr.save(step_no, chunks, opt)
    mgr.wait()
    with torch.no_grad():
        for t in optimizer_tensors(opt):
            t.add_(1)
    mgr.load(chunks, opt)
    after = optimizer_tensors(opt)
    ok = torch.tensor(int(len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))),
                      device=before[0].device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fsdp", action="store_true", help="Megatron-FSDP (default: DDP + distributed optimizer)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--async-save", action="store_true", help="torch DCP async_save (time to commit)")
    ap.add_argument("--threads", type=int, default=None, help="file-writing threads per rank (default: the manager's)")
    ap.add_argument("--read-threads", type=int, default=None, help="file-reading threads per rank (default: the manager's)")
    ap.add_argument("--host-staging", nargs="?", const="on", default="off", choices=("on", "off"),
                    help="CheckpointManager(host_staging=True/False): sync saves copy into reused (pinned) host "
                         "buffers first (default off, the manager's)")
    ap.add_argument("--tensor-format", default="standard", choices=TENSOR_FORMATS,
                    help="CheckpointManager(tensor_format=...): standard (torch.save archives around the tensors' "
                         "memory; stock torch reads them), raw (tensor bytes alone, format 3), or torch_save (DCP's "
                         "own torch.save per tensor, format 2)")
    ap.add_argument("--probe-mb", type=int, default=1024, help="MB per rank for the raw disk-write probe (0: skip)")
    ap.add_argument("--root", default=None, help="checkpoint root (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="JSON result path")
    args = ap.parse_args()

    cfg = EngineConfig(use_megatron_fsdp=args.fsdp, dtype=args.dtype, seed=5)
    rt = runtime.init(cfg)
    spec = GPTSpec(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                   vocab_size=args.vocab, seq_len_tokens=args.seq)
    chunks = engine.build(cfg, gpt_model_fn(spec, cfg))
    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-4), cfg)
    toks = torch.randint(0, spec.vocab_size, (2 * rt.dp_size, spec.seq_len_tokens + 1),
                         generator=torch.Generator().manual_seed(0))
    step(chunks, opt, Batch(toks[:, :-1], toks[:, 1:], torch.ones(toks.shape[0], spec.seq_len_tokens)),
         micro_batch_size=2)
    root = args.root or (tempfile.mkdtemp(prefix="mfsdp_ckpt_bench_") if rt.rank == 0 else None)
    root = Path(collective.broadcast(root))
    mgr = ckpt.CheckpointManager(root, keep_last=1, async_save=args.async_save, write_threads=args.threads,
                                 read_threads=args.read_threads,
                                 host_staging=args.host_staging == "on",
                                 tensor_format=args.tensor_format)
    save_s, load_s, blocking_s, phases, load_phases, nbytes = [], [], [], [], [], 0
    save_cpu_s, load_cpu_s = [], []  # this process's CPU seconds, all its threads: the work, whatever the wall
    for i in range(args.repeats):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        mgr.save(i + 1, chunks, opt)
        mgr.wait()
        dist.barrier()
        save_s.append(time.perf_counter() - t0)
        save_cpu_s.append(time.process_time() - c0)
        blocking_s.append(mgr.last_blocking_s)
        phases.append(dict(mgr.last_save_phases_s))
        t0, c0 = time.perf_counter(), time.process_time()
        meta = mgr.load(chunks, opt)
        dist.barrier()
        load_s.append(time.perf_counter() - t0)
        load_cpu_s.append(time.process_time() - c0)
        load_phases.append(dict(mgr.last_load_phases_s))
        nbytes = meta["bytes"]
    bitwise = round_trip_is_bitwise(mgr, chunks, opt, step_no=args.repeats + 1)
    mgr.close()
    disk = disk_write_gb_per_s(root, args.probe_mb * 2**20) if args.probe_mb else None
    save, load = statistics.median(save_s), statistics.median(load_s)
    phase = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]}
    load_phase = {k: statistics.median(p.get(k, 0.0) for p in load_phases) for k in load_phases[0]}
    result = dict(wrapper=type(chunks[0]).__name__, world_size=rt.world_size, dtype=args.dtype,
                  params=spec.param_count(), checkpoint_bytes=nbytes, save_s=save, load_s=load,
                  save_gb_per_s=nbytes / save / 1e9, load_gb_per_s=nbytes / load / 1e9, async_save=args.async_save,
                  host_staging=mgr.host_staging, tensor_format=args.tensor_format,
                  save_gb_per_s_per_gpu=nbytes / save / 1e9 / rt.world_size, threads=mgr.write_threads,
                  load_gb_per_s_per_gpu=nbytes / load / 1e9 / rt.world_size, read_threads=mgr.read_threads,
                  load_phases_s=load_phase, round_trip_bitwise=bitwise,
                  blocking_s=statistics.median(blocking_s), disk_write_gb_per_s=disk, save_phases_s=phase,
                  save_cpu_s=statistics.median(save_cpu_s), load_cpu_s=statistics.median(load_cpu_s),
                  save_s_all=save_s, load_s_all=load_s, save_phases_s_all=phases, load_phases_s_all=load_phases,
                  device=str(rt.device))
    if rt.rank == 0:
        rows = [("wrapper", result["wrapper"]), ("ranks", rt.world_size), ("params", f"{result['params']:,}"),
                ("format", f"tensor_format={args.tensor_format}"),
                ("checkpoint", f"{nbytes / 1e6:.2f} MB"),
                ("save", f"{save:.3f} s  {result['save_gb_per_s']:.3f} GB/s  "
                         f"({result['save_gb_per_s_per_gpu']:.3f} GB/s per rank; target >= 2 per GPU)"),
                *phase_rows(phase),
                ("  cpu", f"{result['save_cpu_s']:.3f} s of rank 0's CPU time (all threads)"),
                ("  blocked", f"{result['blocking_s']:.3f} s (async: the time training waits)"),
                ("load", f"{load:.3f} s  {result['load_gb_per_s']:.3f} GB/s  ({result['load_gb_per_s_per_gpu']:.3f} "
                         "GB/s per rank; page cache warm)"),
                *phase_rows(load_phase),
                ("  cpu", f"{result['load_cpu_s']:.3f} s of rank 0's CPU time (all threads)"),
                ("disk", "-" if disk is None else f"{disk:.3f} GB/s raw write + fsync, all ranks at once"),
                ("round trip", "bitwise" if bitwise else "NOT BITWISE: a load brought back other optimizer state")]
        print("\n".join(f"{k:<13} {v}" for k, v in rows))
        if args.out:
            write_json(args.out, result)
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    runtime.shutdown(destroy_process_group=True)
    if not bitwise:
        raise SystemExit("checkpoint round trip is not bitwise")


if __name__ == "__main__":
    main()
