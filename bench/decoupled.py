"""Decoupled rollouts (`rl.decoupled`) against the synchronous colocated loop (`loop.fit`) on the same GPUs: seconds
per iteration and the reward curve. torchrun's ranks are split by role: the first WORLD - R are the trainer's world
(Megatron-FSDP), the last R are rollout processes (no world; a `ContinuousRollout` each), joined by a `push.Link`
(NCCL on GPUs) whose store is on trainer rank 0's host. --rollout-procs 0 is the baseline: `loop.fit` over all ranks.

    torchrun --nproc_per_node 8 bench/decoupled.py --rollout-procs 0 --out runs/bench/decoupled_sync.json      # baseline
    torchrun --nproc_per_node 8 bench/decoupled.py --rollout-procs 2 --max-staleness 1 \\
        --out runs/bench/decoupled_6_2_s1.json                                       # 6 trainer + 2 rollout GPUs
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/decoupled.py --rollout-procs 1 --iterations 2   # CPU smoke

--init-from DIR starts from an HF folder (e.g. one `bench/sft_grpo.py --save-rl-start DIR` wrote, so the reward
moves); else a fresh `models.tiny` of --size. The trainer's world uses MASTER_PORT + 1, the link MASTER_PORT + 2.
Iteration seconds: the trainer's wall clock between two iterations' ends (the first, with its warm-up, apart).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from mfsdp_kit.config import EngineConfig, OptimConfig, Wrapper
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.distributed.introspect import torch_dtype
from mfsdp_kit.models import hf as hf_models
from mfsdp_kit.models.tiny import tiny
from mfsdp_kit.perf.report import write_json
from mfsdp_kit.rl import decoupled, loop
from mfsdp_kit.rl.algorithms.grpo import GRPOConfig
from mfsdp_kit.rl.rollout import default_backend
from mfsdp_kit.train import data
from mfsdp_kit.weights import push


def parse_args() -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollout-procs", type=int, default=1, help="the last R ranks sample (0: the synchronous loop)")
    ap.add_argument("--max-staleness", type=int, default=1, help="rl.decoupled's bound (0: synchronous via the link)")
    ap.add_argument("--size", default="l" if gpu else "xs", help="models.tiny size, without --init-from")
    ap.add_argument("--init-from", default=None, help="an HF folder to start from")
    ap.add_argument("--dtype", default="bf16" if gpu else "fp32")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=64, help="prompts per iteration")
    ap.add_argument("--samples", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--workdir", default="runs/bench/decoupled_models")
    ap.add_argument("--out", default="runs/bench/decoupled.json")
    return ap.parse_args()


def _folder(args, rank: int) -> str:
    """The HF folder both roles load (a fresh tiny one is written by rank 0 before any other reads it)."""
    if args.init_from:
        return args.init_from
    path = Path(args.workdir) / f"qwen2-{args.size}"
    done = path / f"done.{os.environ.get('TORCHELASTIC_RUN_ID', '')}.{os.environ['MASTER_PORT']}"   # this run's
    if rank == 0:
        tiny(path, size=args.size)
        done.write_text("")
    while not done.exists():
        time.sleep(0.5)
    return str(path)


def rollout_process(args, src: str, link_rank: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype(args.dtype)).to(device)
    link = push.connect(host=os.environ["MASTER_ADDR"], port=args.link_port, rank=link_rank,
                        size=1 + args.rollout_procs, backend="nccl" if on_gpu else "gloo")
    decoupled.serve(link=link, backend=default_backend(hf, AutoTokenizer.from_pretrained(src)),
                    prompt_pool=data.ArithmeticTask(digits=2).rl_prompts(4000), reward_fn=data.verify)


def trainer(args, src: str, rank: int, world: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ecfg = EngineConfig(wrapper=Wrapper(use_megatron_fsdp=True), dtype=args.dtype)
    rt = runtime.init(ecfg, rank=rank, world_size=world, master_port=args.link_port - 1)   # it sets MASTER_PORT
    model, tok = hf_models.load(src, ecfg), AutoTokenizer.from_pretrained(src)
    optimizer = engine.build_optimizer(model.chunks, OptimConfig(lr=args.lr), ecfg)
    cfg = GRPOConfig(prompts_per_iteration=args.prompts, samples_per_prompt=args.samples,
                     max_new_tokens=args.max_new_tokens, rollout_correction="token-truncate")
    pool, ends = data.ArithmeticTask(digits=2).rl_prompts(4000), [time.perf_counter()]

    def on_iteration(*_):
        ends.append(time.perf_counter())

    if args.rollout_procs == 0:
        hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype(args.dtype)).to(rt.device)
        models = loop.Models(chunks=model.chunks, optimizer=optimizer, bridge=model.bridge,
                             rollout=default_backend(hf, tok))
        history = loop.fit(models=models, cfg=cfg, prompt_pool=pool, reward_fn=data.verify,
                           iterations=args.iterations, on_iteration=on_iteration)
    else:
        link = push.connect(host=os.environ["MASTER_ADDR"], port=args.link_port, rank=0,
                            size=1 + args.rollout_procs, backend="nccl" if rt.device.type == "cuda" else "gloo") \
            if rank == 0 else None
        models = loop.Models(chunks=model.chunks, optimizer=optimizer, bridge=model.bridge, rollout=None)
        history = decoupled.fit(models=models, cfg=cfg, link=link, tokenizer=tok, prompt_pool=pool,
                                iterations=args.iterations, max_staleness=args.max_staleness,
                                on_iteration=on_iteration)
    seconds = [b - a for a, b in zip(ends, ends[1:])]
    if rank == 0:
        steady = sorted(seconds[1:]) or seconds
        write_json(args.out, dict(args=vars(args), trainer_ranks=world, iteration_s=seconds,
                                  median_iteration_s=steady[len(steady) // 2], history=vars(history)))
    runtime.shutdown()


def main() -> None:
    args = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainers = world - args.rollout_procs
    if not 0 <= args.rollout_procs < world:
        raise SystemExit(f"--rollout-procs={args.rollout_procs} is not allowed; allowed: 0 .. {world - 1}")
    src = _folder(args, rank)
    args.link_port = int(os.environ["MASTER_PORT"]) + 2
    if rank >= trainers:
        rollout_process(args, src, link_rank=rank - trainers + 1)
    else:
        trainer(args, src, rank, trainers)


if __name__ == "__main__":
    main()
