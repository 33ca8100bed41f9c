"""A real-size HF load: a ~7-8 B folder written on this node, loaded into Megatron-FSDP by `models.hf.load`'s
phases on every rank, with time, host RSS and GPU memory per phase and rank.

    torchrun --nproc_per_node 2 bench/load_hf.py --shape qwen2.5-7b --root /dev/shm --out runs/bench/load_7b.json
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/load_hf.py --shape small     # CPU smoke run, gloo

Rank 0 writes the folder (`perf.hf_folder.write_folder`): the shape's config.json (Qwen2.5-7B or
Llama-3-8B, as transformers writes it), random bf16 weights in safetensors shards of --shard-gb with a
model.safetensors.index.json, and no tokenizer (loading needs none). Then every rank runs
`models.hf.load(path, cfg, phases=...)`, which times each of its steps:

    check     check_folder: config support, heads, safetensors headers against the architecture
    provider  the Megatron-Bridge provider from config.json (no weights read)
    build     engine.build(wrap=False): the full, unsharded model on this rank's device
    weights   bridge.load_hf_weights: every tensor read from the shards, converted, copied in
    wrap      engine.wrap_chunks: Megatron-FSDP shards (optim_grads_params) copied out of the full model
    settle    gc + empty_cache: what is left once the unsharded model is dropped
    train     (--train-steps) the distributed optimizer and steps on random tokens: the load is usable

Per phase and rank: seconds, host RSS at the end and the process's peak RSS so far (ru_maxrss, which
counts the mmapped shard pages a rank touched), peak and end GPU memory allocated.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from mfsdp_kit.train import data
from mfsdp_kit import train
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.models import hf as hf_models
from mfsdp_kit.perf.hf_folder import SHAPES, hf_config, remove_for_world, write_for_world
from mfsdp_kit.perf.phases import Phases, settle
from mfsdp_kit.perf.report import write_json

def train_steps(chunks, cfg: EngineConfig, *, steps: int, seq_len: int, vocab_size: int) -> list[float]:
    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-5), cfg)
    batches = data.random_token_batches(steps=steps, global_batch=dist.get_world_size(), seq_len_tokens=seq_len,
                                        vocab_size=vocab_size)
    return [train.step(chunks, opt, b, micro_batch_size=1, step_index=i).loss for i, b in enumerate(batches)]


def table(rows_by_rank: list[list[dict]]) -> str:
    gib = 2**30
    lines = [f"{'phase':<9}{'rank':>5}{'seconds':>9}{'RSS GiB':>9}{'peak RSS':>10}{'GPU peak':>10}{'GPU end':>9}"]
    for i in range(len(rows_by_rank[0])):
        for rank, rows in enumerate(rows_by_rank):
            r = rows[i]
            lines.append(f"{r['phase']:<9}{rank:>5}{r['seconds']:>9.2f}{r['rss_bytes'] / gib:>9.2f}"
                         f"{r['peak_rss_bytes'] / gib:>10.2f}{r['gpu_peak_bytes'] / gib:>10.2f}{r['gpu_end_bytes'] / gib:>9.2f}")
    return "\n".join(lines)


def main() -> None:
    on_gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b" if on_gpu else "small")
    ap.add_argument("--root", default="/dev/shm", help="where the folder is written (falls back to /tmp, runs/)")
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--dtype", default="bf16" if on_gpu else "fp32", choices=["bf16", "fp32"])
    ap.add_argument("--train-steps", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--keep", action="store_true", help="keep the folder (default: removed at the end)")
    ap.add_argument("--out", default="runs/bench/load_hf.json")
    args = ap.parse_args()
    cfg = EngineConfig(use_megatron_fsdp=True, dtype=args.dtype)
    runtime.init(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = hf_config(args.shape)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    path, write = write_for_world(f"mfsdp_load_{args.shape}", args.shape, root=args.root, shard_gb=args.shard_gb)
    if rank == 0:
        print(f"wrote {path}: {write['params'] / 1e9:.3f} B params, {write['bytes'] / 2**30:.2f} GiB in "
              f"{write['shards']} shards, {write['seconds']:.1f} s", flush=True)
    settle()
    phases = Phases()
    chunks = hf_models.load(path, cfg, phases=phases).chunks
    phases.run("settle", settle)
    losses = []
    if args.train_steps:
        losses = phases.run("train", train_steps, chunks, cfg, steps=args.train_steps, vocab_size=config.vocab_size,
                            seq_len=min(args.seq_len, config.max_position_embeddings))
    load_s = sum(r["seconds"] for r in phases.rows if r["phase"] not in ("train",))
    gathered = [None] * world
    dist.all_gather_object(gathered, dict(rank=rank, phases=phases.rows, load_s=load_s, losses=losses))
    if rank == 0:
        gib = 2**30
        print(f"\n{args.shape}: {params / 1e9:.3f} B params, {write['bytes'] / gib:.2f} GiB bf16 in {path.parent}, "
              f"{world} ranks, Megatron-FSDP ({args.dtype}); load (check..settle) "
              f"{max(g['load_s'] for g in gathered):.1f} s; losses {losses}")
        print(table([g["phases"] for g in gathered]))
        res = dict(args=vars(args), world=world, device=torch.cuda.get_device_name(0) if on_gpu else "cpu",
                   params=params, folder=str(path), write=write, ranks=gathered,
                   peak_rss_bytes=max(r["peak_rss_bytes"] for g in gathered for r in g["phases"]),
                   gpu_peak_bytes=max(r["gpu_peak_bytes"] for g in gathered for r in g["phases"]))
        write_json(args.out, res)
    remove_for_world(path, keep=args.keep)
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
