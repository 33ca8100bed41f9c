"""GRPO on your own model folder and problems, as one command (the shape of verl's Megatron-FSDP GSM8K example).

    torchrun --nproc_per_node 8 -m mfsdp_kit.rl.cli --model /models/Qwen2.5-7B-Instruct \
        --data gsm8k/train.parquet --prompt-field question --answer-field answer --reward gsm8k \
        --iterations 100 --prompts 64 --samples 8 --max-new-tokens 1024 --out runs/grpo_gsm8k

One rank per GPU (NCCL), or 2 CPU ranks (gloo) for a small model. Every step is the notebooks' library call:
`models.hf.load` (Megatron-FSDP, `optim_grads_params`), `rl.problems.load_problems` (JSONL or parquet, your field
names, rendered with the folder's chat template), `rl.rewards` (GSM8K's `#### answer` or MATH's `\\boxed{}`,
graded against each prompt's gold), the kit's rollout engine over an HF copy of the folder refreshed every
iteration, `grpo.fit` (any `GRPOConfig` field is an option: `--help`), then `sync.save_hf` into `--out/hf` and the
history into `--out/history.json`. Bad options and a bad data file stop it before any model is loaded.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import rewards

REWARDS = {"gsm8k": rewards.gsm8k, "math": rewards.math}
"""--reward: how a completion is graded against its problem's gold answer."""


def parse(argv=None) -> argparse.Namespace:
    from ..perf import options
    from . import grpo
    p = argparse.ArgumentParser(prog="python -m mfsdp_kit.rl.cli", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="an HF model folder (weights, config, tokenizer with a chat template)")
    p.add_argument("--data", required=True, help="problems: a .jsonl or .parquet file")
    p.add_argument("--prompt-field", default="question", help="the question's field or column")
    p.add_argument("--answer-field", default="answer", help="the gold answer's field or column")
    p.add_argument("--reward", choices=sorted(REWARDS), default="gsm8k")
    p.add_argument("--limit", type=int, default=None, help="read at most this many problems")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--out", required=True, help="folder for hf/ (the trained model) and history.json; must not exist")
    options.add_options(p, grpo.GRPOConfig, prefix="", names=dict(prompts_per_iteration="prompts",
                                                                  samples_per_prompt="samples"))
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Parse, check the data and the output folder, train, save; returns the history (rank 0 prints it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..distributed import engine, runtime
    from ..weights import sync
    from ..config import EngineConfig, OptimConfig, Wrapper
    from ..distributed.introspect import torch_dtype
    from ..models.hf import load
    from ..perf import options
    from . import grpo
    from .problems import load_problems
    args = parse(argv)
    out = Path(args.out)
    if out.exists():
        raise FileExistsError(f"--out {out} exists: name a new folder")
    cfg = options.build(grpo.GRPOConfig, args, prefix="")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    problems = load_problems(args.data, tokenizer, prompt_field=args.prompt_field, answer_field=args.answer_field,
                             limit=args.limit)   # a bad file stops here, before any rank loads a weight
    gpu = torch.cuda.is_available()
    engine_cfg = EngineConfig(wrapper=Wrapper(use_megatron_fsdp=True), dtype="bf16" if gpu else "fp32")
    rt = runtime.init(engine_cfg)
    model = load(args.model, engine_cfg)
    optimizer = engine.build_optimizer(model.chunks, OptimConfig(lr=args.lr), engine_cfg)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch_dtype(engine_cfg.dtype)).to(rt.device)
    history = grpo.fit(chunks=model.chunks, optimizer=optimizer, bridge=model.bridge,
                       rollout=grpo.Rollout(hf, tokenizer), prompt_pool=problems,
                       reward_fn=rewards.gold_reward(problems, grade=REWARDS[args.reward]), cfg=cfg,
                       iterations=args.iterations, progress=rt.rank == 0)
    sync.save_hf(model.chunks, model.bridge, out / "hf")   # weights, config and the folder's tokenizer
    metrics = vars(history)
    if rt.rank == 0:
        (out / "history.json").write_text(json.dumps(metrics, indent=1))
        for i, (r, a) in enumerate(zip(history.reward, history.accuracy)):
            print(f"iteration {i}: reward {r:.3f}, accuracy {a:.3f}")
    runtime.shutdown()
    return metrics


if __name__ == "__main__":
    main()
