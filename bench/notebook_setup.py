"""Where a notebook's set-up time goes on this machine: the one-time write of its tiny model, then, per wrapper,
each phase of `models.hf.load` and the first training steps, in one process per rank.

    torchrun --nproc_per_node 1 bench/notebook_setup.py --out runs/bench/notebook_setup.json
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/notebook_setup.py --size xs     # CPU smoke run, gloo

The notebooks' first cells write the model once per machine (`models.tiny.cached`) and every notebook loads it
one or more times (01_wrap twice, 06_memory four times), so on a GPU node these phases, not the training, are
most of the suite's time. Rank 0 writes the model into a fresh folder (timed: drawing the weights, then the
whole `tiny.tiny`), then every rank runs, per wrapper, `runtime.init` and `models.hf.load` (its `phases` hook
times each of its steps), then 3 steps of 02_sft's shape (32 sequences x 16 tokens).
`--profile N` adds the N functions with the most cumulative time over rank 0's loads and steps (cProfile).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import tempfile

import torch
import torch.distributed as dist

from mfsdp_kit import cache, train
from mfsdp_kit.notebook import model as notebook_model
from mfsdp_kit.train import data
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import OptimConfig
from mfsdp_kit.models import hf as hf_models
from mfsdp_kit.models.tiny import param_count, state_dict, tiny
from mfsdp_kit.perf.phases import Phases, settle
from mfsdp_kit.perf.report import write_json

LOAD_PHASES = ("check", "provider", "build", "weights", "wrap")


def write_model(phases: Phases, *, size: str, root) -> str:
    """Rank 0 writes the tiny model into a fresh folder under `root` (where the real cache lives): first the
    imports it needs (transformers' model class, built on the meta device), then the draw alone, then all of it."""
    path = tempfile.mkdtemp(prefix=f".bench-{size}-", dir=root)
    phases.run("imports", param_count, size)
    phases.run("draw", state_dict, size=size)
    phases.run("tiny", tiny, path, size=size)
    return path


def load_and_step(phases: Phases, nbm, path: str, *, fsdp: bool, steps: int, profile=None) -> None:
    """`runtime.init` and `models.hf.load` (timed per step by its `phases` hook) under the notebook's config, the
    optimizer, then `steps` steps of 02_sft's shape (all under `profile` if given); rows named `<wrapper>.<phase>`."""
    mine = Phases()
    if profile:
        profile.enable()
    cfg = nbm.engine_config(use_megatron_fsdp=fsdp)
    mine.run("init", runtime.init, cfg)
    model = hf_models.load(path, cfg, phases=mine)
    opt = mine.run("optimizer", engine.build_optimizer, model.chunks, OptimConfig(lr=1e-5), cfg)
    batches = data.random_token_batches(steps=steps, global_batch=32, seq_len_tokens=16, vocab_size=model.vocab_size)
    for i, batch in enumerate(batches):
        mine.run(f"step{i}", train.step, model.chunks, opt, batch, micro_batch_size=32 // dist.get_world_size(),
                 step_index=i)
    if profile:
        profile.disable()
    del model, opt
    mine.run("settle", settle)
    name = "fsdp" if fsdp else "ddp"
    phases.rows += [dict(row, phase=f"{name}.{row['phase']}") for row in mine.rows]


def top_functions(profile: cProfile.Profile, n: int) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(n)
    return out.getvalue()


def table(rows_by_rank: list[list[dict]]) -> str:
    """Rank 0's phases (it alone writes the model), each with every rank's seconds where that rank ran it."""
    by_rank = [{r["phase"]: r for r in rows} for rows in rows_by_rank]
    lines = [f"{'phase':<16}" + "".join(f"{'rank ' + str(r) + ' s':>10}" for r in range(len(by_rank)))
             + f"{'GPU peak GiB':>14}"]
    for row in rows_by_rank[0]:
        secs = "".join(f"{rows[row['phase']]['seconds']:>10.3f}" if row["phase"] in rows else f"{'':>10}"
                       for rows in by_rank)
        lines.append(f"{row['phase']:<16}{secs}{row['gpu_peak_bytes'] / 2**30:>14.2f}")
    return "\n".join(lines)


def main() -> None:
    on_gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=notebook_model.TINY_SIZES, default=notebook_model.DEFAULT_SIZE[on_gpu])
    ap.add_argument("--root", default=None, help="where rank 0 writes the model (default: the kit's cache root)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, help="the N functions with most cumulative time (loads, steps)")
    ap.add_argument("--out", default="runs/bench/notebook_setup.json")
    args = ap.parse_args()
    runtime.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    phases = Phases()
    root = args.root or cache.root()
    box = [write_model(phases, size=args.size, root=root) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = box[0]
    nbm = notebook_model.prepare(path, on_gpu=on_gpu)
    profile = cProfile.Profile() if args.profile and rank == 0 else None
    for fsdp in (False, True):
        load_and_step(phases, nbm, path, fsdp=fsdp, steps=args.steps, profile=profile)
    gathered = [None] * world
    dist.all_gather_object(gathered, phases.rows)
    if rank == 0:
        write_s = {"imports": phases.seconds("imports"), "draw": phases.seconds("draw"),
                   "write": phases.seconds("tiny") - phases.seconds("draw")}
        loads = {w: phases.seconds(*(f"{w}.{p}" for p in ("init",) + LOAD_PHASES)) for w in ("ddp", "fsdp")}
        print(f"{args.size} ({nbm.dtype}, attention {nbm.attention_backend}), {world} rank(s) on "
              f"{torch.cuda.get_device_name(0) if on_gpu else 'cpu'}: model write {sum(write_s.values()):.2f} s "
              f"(imports {write_s['imports']:.2f}, draw {write_s['draw']:.2f}), load DDP {loads['ddp']:.2f} s, "
              f"Megatron-FSDP {loads['fsdp']:.2f} s")
        print(table(gathered))
        res = dict(args=vars(args), world=world, device=torch.cuda.get_device_name(0) if on_gpu else "cpu",
                   dtype=nbm.dtype, attention=nbm.attention_backend, model_write_s=write_s, load_s=loads,
                   ranks=gathered)
        if profile:
            res["profile"] = top_functions(profile, args.profile)
            print(res["profile"])
        write_json(args.out, res)
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
