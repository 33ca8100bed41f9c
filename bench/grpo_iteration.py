"""One GRPO iteration at research scale on one GPU, and where its time goes: HF `generate` against the kit's
rollout engine (`rl.rollout.ContinuousRollout`), the same model, prompts and seeds.

    python bench/grpo_iteration.py --size l --iterations 3 --out runs/bench/grpo_iteration.json   # 1 GPU
    python bench/grpo_iteration.py --size xs --prompts 4 --samples 2 --max-new-tokens 16 --iterations 1  # CPU

The setting of issue 37: the tiny `l` model (1.7 B, bf16, Megatron-FSDP), untrained, so its responses run long
(written with 1024 positions for that), 64 prompts x 8 samples of the 3-digit arithmetic
task, up to 512 new tokens at T 1. Each iteration is split into sync (weights into the rollout model), rollout,
logprob (old log-probs) and update seconds (`GRPOHistory`), with the mean response length and the
train-inference log-prob mismatch. Prints a table per backend and writes JSON; `plots.iteration_time` draws it.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from mfsdp_kit import data, engine, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.introspect import torch_dtype
from mfsdp_kit.models.hf import load
from mfsdp_kit.models.tiny import tiny
from mfsdp_kit.perf import options
from mfsdp_kit.perf.report import write_json
from mfsdp_kit.rl import grpo
from mfsdp_kit.rl.rollout import ContinuousRollout, DecodeConfig, HFRollout

SPLIT = ("sync_s", "rollout_s", "logprob_s", "update_s")


def model_folder(size: str, *, positions: int) -> str:
    """A tiny model of `size` written once per run on rank 0, with `positions` rotary positions."""
    src = f"/tmp/mfsdp_grpo_iteration_{size}"
    if runtime.current().rank == 0:
        tiny(src, size=size, seed=0, positions=positions)
    dist.barrier()
    return src


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="l")
    p.add_argument("--iterations", type=int, default=3)
    options.add_options(p, grpo.GRPOConfig, prefix="", names=dict(prompts_per_iteration="prompts",
                                                                  samples_per_prompt="samples"),
                        defaults=dict(prompts_per_iteration=64, samples_per_prompt=8, max_new_tokens=512))
    p.add_argument("--backends", default="hf,continuous,continuous_kept",
                   help="hf, continuous (cache freed after each rollout), continuous_kept (cache and graphs kept)")
    p.add_argument("--out", default="runs/bench/grpo_iteration.json")
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    cfg = EngineConfig(use_megatron_fsdp=True, dtype="bf16" if gpu else "fp32", seed=0)
    rt = runtime.init(cfg)
    src = model_folder(args.size, positions=1024)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(src)
    model = load(src, cfg)
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-6), cfg)
    pool = data.ArithmeticTask(digits=3).rl_prompts(1000)
    gcfg = options.build(grpo.GRPOConfig, args, prefix="")
    results = {}
    for name in args.backends.split(","):
        hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype(cfg.dtype)).to(rt.device)
        rollout = (HFRollout(hf, tok) if name == "hf" else
                   ContinuousRollout(hf, tok, config=DecodeConfig(keep_cache=name == "continuous_kept")))
        engine_stats = []
        history = grpo.fit(chunks=model.chunks, optimizer=opt, bridge=model.bridge, rollout=rollout, prompt_pool=pool,
                           reward_fn=data.verify, gcfg=gcfg, iterations=args.iterations, progress=False,
                           on_iteration=lambda *_: engine_stats.append(dict(getattr(rollout, "stats", {}))))
        results[name] = dict(vars(history), engine=engine_stats)
        del rollout, hf
        torch.cuda.empty_cache() if gpu else None
        if rt.rank == 0:
            print(f"\n{name}: {gcfg.prompts_per_iteration} prompts x {gcfg.samples_per_prompt} samples, <= {gcfg.max_new_tokens} new tokens")
            print(f"{'it':>3} " + " ".join(f"{k:>10}" for k in SPLIT) + f" {'total s':>8} {'rollout %':>9} "
                  f"{'resp tok':>8} {'tok/s':>8} {'|dlogp| mean':>12} {'max':>8}")
            for i in range(args.iterations):
                split = [results[name][k][i] for k in SPLIT]
                n_tok = results[name]["response_tokens"][i] * gcfg.prompts_per_iteration * gcfg.samples_per_prompt
                print(f"{i:>3} " + " ".join(f"{x:>10.2f}" for x in split) + f" {sum(split):>8.2f} "
                      f"{100 * split[1] / sum(split):>9.1f} {results[name]['response_tokens'][i]:>8.1f} "
                      f"{n_tok / split[1]:>8.0f} {results[name]['logprob_diff_mean'][i]:>12.4f} "
                      f"{results[name]['logprob_diff_max'][i]:>8.3f}")
                if engine_stats[i]:
                    print("     engine: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                   for k, v in engine_stats[i].items()))
    if rt.rank == 0:
        write_json(args.out, dict(args=vars(args), device=torch.cuda.get_device_name() if gpu else "cpu",
                                  histories=results))
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
