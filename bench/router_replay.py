"""MoE router replay: how often the trainer's router picks other experts than the rollout engine did, and the
log-prob mismatch with and without replaying the rollout's choice (`rl.scoring.routing_mismatch`), on the tiny
transformers-made MoE models, the rollout engine and the trainer both in `--dtype`.

    torchrun --nproc_per_node 1 bench/router_replay.py --dtype bf16 --out runs/gpu/router_replay.json

A GRPO-style collect (arithmetic prompts, temperature 1) with `routes=True`, then the trainer (Megatron-FSDP)
scores the samples twice. No hardware floor applies: these are error figures, not speeds.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import transformers

from mfsdp_kit.train import data
from mfsdp_kit.config import EngineConfig
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.models import archs, hf as hf_models
from mfsdp_kit.perf.report import write_json
from mfsdp_kit.rl import core, scoring
from mfsdp_kit.rl.rollout import ContinuousRollout
from mfsdp_kit.train import chat

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure(arch: str, args, cfg: EngineConfig, rank: int) -> dict:
    src = f"{args.root}/{arch}"
    if rank == 0:
        archs.write_tiny(arch, src)
    dist.barrier()
    tok = transformers.AutoTokenizer.from_pretrained(src)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=DTYPES[args.dtype])
    rollout = ContinuousRollout(hf.to(runtime.current().device), tok)
    model = hf_models.load(src, cfg)
    prompts = data.ArithmeticTask(digits=2).rl_prompts(args.prompts)
    batch = core.collect(chunks=model.chunks, bridge=model.bridge, backend=rollout, prompts=prompts,
                         reward=data.verify, samples_per_prompt=args.samples, max_new_tokens=args.max_new_tokens,
                         temperature=1.0, top_p=1.0, seed=args.seed, routes=True)
    seq = core.seq_len_needed(prompts, tok, max_new_tokens=args.max_new_tokens)
    per_rank = len(batch.completions) // dist.get_world_size()
    out = scoring.routing_mismatch(model.chunks, batch, seq_len_tokens=seq, pad_id=chat.pad_id(tok),
                                   micro_batch_size=min(8, per_rank))
    engine.release(model.chunks)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", nargs="+", default=["Qwen3MoeForCausalLM", "OlmoeForCausalLM"])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the trainer's and the rollout's")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", default="/tmp/mfsdp_router_replay", help="where the tiny models are written")
    ap.add_argument("--out", default="runs/bench/router_replay.json")
    args = ap.parse_args()
    cfg = EngineConfig(use_megatron_fsdp=True, dtype=args.dtype, seed=args.seed)
    rt = runtime.init(cfg)
    rows = {arch: measure(arch, args, cfg, rt.rank) for arch in args.archs}
    if rt.rank == 0:
        print(f"{'architecture':<22}{'tokens':>8}{'flips %':>9}{'|d| mean w/o':>14}{'with':>10}{'|d| max w/o':>13}"
              f"{'with':>10}")
        for arch, r in rows.items():
            print(f"{arch:<22}{r['tokens']:>8}{100 * r['flips']:>9.2f}{r['diff_mean_without']:>14.2e}"
                  f"{r['diff_mean_with']:>10.2e}{r['diff_max_without']:>13.2e}{r['diff_max_with']:>10.2e}")
        write_json(args.out, dict(rows=rows, dtype=args.dtype, prompts=args.prompts, samples=args.samples,
                                  max_new_tokens=args.max_new_tokens))
    runtime.shutdown()


if __name__ == "__main__":
    main()
