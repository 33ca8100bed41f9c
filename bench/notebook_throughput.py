"""06_memory's speed cell as a script: `notebook_model.throughput` for DDP and Megatron-FSDP on every GPU,
with the model the notebooks' knob picks (MFSDP_MODEL; default tiny mw in bf16 on GPUs, xs in fp32 on CPU).

    torchrun --nproc_per_node 2 bench/notebook_throughput.py --out runs/bench/notebook_throughput.json
    MFSDP_MODEL=l torchrun --nproc_per_node 2 bench/notebook_throughput.py            # the 1.70 B tiny model

nbval runs 06_memory but keeps none of its output; this prints the same table (tokens/s per GPU, MFU,
step time, peak memory, model state against the ZeRO formula) and writes it as JSON.
"""
from __future__ import annotations

import argparse
import os

import torch.distributed as dist

from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.notebook import model as notebook_model
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.models.hf import load
from mfsdp_kit.perf.report import write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default: throughput()'s)")
    ap.add_argument("--micro-batch-size", type=int, default=None, help="per rank (default: throughput()'s)")
    ap.add_argument("--out", default="runs/bench/notebook_throughput.json")
    args = ap.parse_args()
    runtime.init(EngineConfig())
    nbm = notebook_model.prepare(workdir=f"/tmp/mfsdp_nbt_{os.getpid()}")   # each rank writes its own (seeded)
    results = {}
    for name, fsdp in (("DDP", False), ("FSDP", True)):
        cfg = nbm.engine_config(use_megatron_fsdp=fsdp)
        runtime.init(cfg)
        model = load(nbm.path, cfg)
        opt = engine.build_optimizer(model.chunks, OptimConfig(lr=nbm.lr(1e-3)), cfg)
        results[f"{name} N={dist.get_world_size()}"] = notebook_model.throughput(
            model.chunks, opt, nbm=nbm, steps=args.steps, micro_batch_size=args.micro_batch_size)
        engine.release(model.chunks)
        del model, opt
    if dist.get_rank() == 0:
        print(nbm)
        print(notebook_model.format_throughput(results))
        write_json(args.out, results)
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
