"""SFT then GRPO on the embedded arithmetic task, with Megatron-FSDP: accuracy, time, memory.

    torchrun --nproc_per_node 2 bench/sft_grpo.py --size m --out runs/bench/sft_grpo.json          # GPU
    SECTIONS="grpo_start grpo" bash scripts/gpu_check.sh       # the issue-7 GPU run (docs/benchmarks.md)
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/sft_grpo.py --size xs --sft-steps 150 \
        --sft-digits 1 --rl-digits 1 --rl-sft-steps 20 --grpo-iterations 3                          # CPU smoke

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/sft_grpo.py --size s --skip-sft1 --rl-digits 2 \
        --rl-sft-steps 0 --init-from DIR --grpo-eval-every 10 ...                                    # CPU GRPO sweeps
        (DIR written once by a run with --save-rl-start DIR: the sweeps then skip the SFT)
    ... --save-rl-start DIR --ceiling-sft-steps 60                                                # + gold-SFT control

Stage 1 (SFT): a fresh tiny model learns --sft-digits addition; held-out exact match before/after
(--skip-sft1: none; stage 2 then starts from the fresh model).
Stage 2 (GRPO): a short SFT on a harder level (--rl-digits) leaves accuracy well below 100 %;
GRPO then trains on rewards (--grpo-reward: exact match, or per-digit partial credit); held-out
exact-match accuracy before/after (and every --grpo-eval-every iterations), of the greedy answer and
of --grpo-eval-samples samples per prompt at --grpo-temperature,
reward curve, and sync time / GB/s per iteration. Prints a table and writes JSON.
Control (--ceiling-sft-steps N): a copy of GRPO's start model gets N gold-answer SFT steps: what perfect
supervision gains in about as many updates (on CPU, size s, 2 digits, from 0.50: +9.5..+11 points in 60 steps at
lr 3e-5, at most +4.5 in 30, while no GRPO setting tried gained more than +3 in 30-60 iterations; so a +10
GRPO target needs a start where that ceiling is well above +10).
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import torch.distributed as dist

from mfsdp_kit.train import data, generate
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.distributed.introspect import torch_dtype
from mfsdp_kit.distributed.memory import format_table, memory_report
from mfsdp_kit.models.hf import load
from mfsdp_kit.models.tiny import tiny
from mfsdp_kit.rl import grpo
from mfsdp_kit.rl.rollout import DecodeConfig
from mfsdp_kit.train import StepOptions, fit
from mfsdp_kit.train import step as train_step
from mfsdp_kit.perf import options
from mfsdp_kit.perf.report import write_json


def sft_pairs(task) -> list:
    """The SFT training pairs of `task`: for 1-2 digits (nearly) all of its train split."""
    return task.train_pairs({1: 90, 2: 8000}.get(task.digits, 20_000))


def sft(model, tok, cfg, *, task, steps: int, lr: float, global_batch: int, how: StepOptions,
        heldout, seq_len: int) -> dict:
    ocfg = OptimConfig(lr=lr, warmup_steps=max(steps // 20, 1), decay_steps=steps, min_lr=lr / 10)
    opt = engine.build_optimizer(model.chunks, ocfg, cfg)
    sched = engine.build_scheduler(opt, ocfg, total_steps=steps)
    before = generate.evaluate(model.chunks, tok, heldout, reward_fn=data.verify)["accuracy"]
    t0 = time.perf_counter()
    batches = data.batches(sft_pairs(task), tok, seq_len_tokens=seq_len, global_batch=global_batch)
    history = fit(model.chunks, opt, batches, steps=steps, options=dataclasses.replace(how, scheduler=sched))
    seconds = time.perf_counter() - t0
    after = generate.evaluate(model.chunks, tok, heldout, reward_fn=data.verify)["accuracy"]
    return dict(steps=steps, seconds=seconds, loss_first=history.loss[0], loss_last=history.loss[-1],
                accuracy_before=before, accuracy_after=after, report=memory_report(model.chunks, opt))


def sampled_accuracy(rollout, model, heldout, *, samples: int, temperature: float, max_new_tokens: int,
                     seed: int) -> float:
    """Held-out exact match of the policy's own samples (mean over `samples` per prompt at
    `temperature`): what GRPO optimises, next to the greedy accuracy the curve reports."""
    from megatron.core import parallel_state as ps
    rollout.refresh(model.chunks, model.bridge)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = heldout[rank * len(heldout) // dp:(rank + 1) * len(heldout) // dp]
    completions = rollout.sample([p for p, _ in share], n=samples, max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_p=1.0, seed=seed + rank)
    hits = sum(data.verify(share[i // samples][0], rollout.tokenizer.decode(c)) for i, c in enumerate(completions))
    score = torch.tensor([hits, len(completions)], dtype=torch.float64, device=runtime.current().device)
    dist.all_reduce(score, group=ps.get_data_parallel_group())
    return (score[0] / score[1]).item()


def _set_lr(opt, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


GRPO_FLAGS = dict(prompts_per_iteration="prompts", samples_per_prompt="samples", num_minibatches="minibatches",
                  ppo_epochs="epochs", kl_coef="kl", warmup_steps="warmup", adam_beta2="beta2")
"""The shorter spellings this script's `--grpo-*` flags have always had (docs/benchmarks.md, scripts/gpu_sections.py)."""


def grpo_flags(ap: argparse.ArgumentParser, gpu: bool) -> None:
    """GRPOConfig's and OptimConfig's fields as `--grpo-*` options (perf.options), then the script's own."""
    options.add_options(ap, grpo.GRPOConfig, prefix="grpo", names=GRPO_FLAGS, skip=("max_new_tokens",),
                        defaults=dict(prompts_per_iteration=32 if gpu else 8, samples_per_prompt=8 if gpu else 4,
                                      num_minibatches=2, micro_batch_size=None))   # None: --micro-batch-size
    options.add_options(ap, OptimConfig, prefix="grpo", names=GRPO_FLAGS, skip=("min_lr", "decay_steps"),
                        defaults=dict(lr=3e-5, adam_beta2=0.95))
    g = ap.add_argument_group("GRPO, this script's")
    g.add_argument("--grpo-iterations", type=int, default=60, help="0 = stop after the SFT (e.g. with --save-rl-start)")
    g.add_argument("--grpo-reward", choices=sorted(data.REWARDS), default="exact",
                   help="training reward; held-out accuracy is always exact match")
    g.add_argument("--grpo-cosine", action="store_true",
                   help="cosine lr decay to lr/100 over the steps after the warm-up (default: constant lr)")
    g.add_argument("--grpo-prime-sft", type=int, default=0,
                   help="gold-data SFT steps at lr 0 on the GRPO optimizer before GRPO (Adam moments as after SFT)")
    g.add_argument("--grpo-eval-every", type=int, default=0, help="held-out accuracy every k iterations (0 = off)")
    g.add_argument("--grpo-eval-samples", type=int, default=4,
                   help="samples per held-out prompt for the sampled accuracy at --grpo-temperature (0 = greedy only)")
    g.add_argument("--rollout-weights", default="model", choices=("model", "fp8"),
                   help="the rollout engine's projection weights (DecodeConfig.weights): the model's, or FP8 (sm89+)")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    ap.add_argument("--size", default="m" if gpu else "xs")
    ap.add_argument("--dtype", default="bf16" if gpu else "fp32")
    ap.add_argument("--skip-sft1", action="store_true", help="no stage 1: start stage 2 from the fresh model")
    ap.add_argument("--sft-digits", type=int, default=2)
    ap.add_argument("--sft-steps", type=int, default=600)
    ap.add_argument("--sft-lr", type=float, default=3e-4)
    ap.add_argument("--rl-digits", type=int, default=3)
    ap.add_argument("--rl-sft-steps", type=int, default=100, help="SFT steps per round on the RL task (0 = none)")
    ap.add_argument("--rl-sft-max-steps", type=int, default=800)
    ap.add_argument("--rl-start-accuracy", type=float, default=0.3)
    ap.add_argument("--init-from", default=None, help="HF folder to start from instead of a fresh tiny model")
    ap.add_argument("--save-rl-start", default=None, help="write the model GRPO starts from as an HF folder here")
    ap.add_argument("--ceiling-sft-steps", type=int, default=0,
                    help="control: a copy of GRPO's start model (needs --save-rl-start) gets this many gold-data SFT "
                         "steps at --ceiling-sft-lr: what perfect supervision gains in a comparable number of updates")
    ap.add_argument("--ceiling-sft-lr", type=float, default=3e-5)
    grpo_flags(ap, gpu)
    ap.add_argument("--global-batch", type=int, default=64)
    options.add_options(ap, StepOptions, prefix="", defaults=dict(micro_batch_size=32), title="SFT's StepOptions")
    ap.add_argument("--heldout", type=int, default=200)
    ap.add_argument("--out", default="runs/bench/sft_grpo.json")
    return ap.parse_args()


def sft_stages(args, cfg, model, tok) -> dict:
    """Stage 1 (--sft-digits) unless skipped, then SFT rounds on the RL task up to the start accuracy;
    saves the start (--save-rl-start) and runs the gold-SFT control on a copy of it."""
    out, how = dict(sft=None, ceiling_sft=None), options.build(StepOptions, args, prefix="")
    if not args.skip_sft1:
        task1 = data.ArithmeticTask(digits=args.sft_digits)
        n1 = min(args.heldout, 10) if args.sft_digits == 1 else args.heldout
        out["sft"] = sft(model, tok, cfg, task=task1, steps=args.sft_steps, lr=args.sft_lr,
                         global_batch=args.global_batch, how=how, heldout=task1.rl_prompts(n1, split="heldout"),
                         seq_len=args.seq)
    # SFT in rounds until held-out accuracy reaches --rl-start-accuracy (or --rl-sft-max-steps): GRPO
    # needs groups whose samples disagree, and a model at a few percent gives almost none.
    rounds, done = [], 0
    while args.rl_sft_steps > 0:
        rounds.append(sft(model, tok, cfg, task=args.task2, steps=args.rl_sft_steps, lr=args.sft_lr,
                          global_batch=args.global_batch, how=how, heldout=args.held2, seq_len=args.seq))
        done = sum(r["steps"] for r in rounds)
        if rounds[-1]["accuracy_after"] >= args.rl_start_accuracy or done >= args.rl_sft_max_steps:
            break
    if rounds:
        out["rl_sft"] = dict(rounds[-1], steps=done, seconds=sum(r["seconds"] for r in rounds),
                             accuracy_by_round=[r["accuracy_after"] for r in rounds])
    else:
        acc = generate.evaluate(model.chunks, tok, args.held2, reward_fn=data.verify)["accuracy"]
        out["rl_sft"] = dict(steps=0, seconds=0.0, accuracy_after=acc, accuracy_by_round=[])
    if args.save_rl_start:
        from mfsdp_kit.weights import sync
        sync.save_hf(model.chunks, model.bridge, args.save_rl_start)
    if args.ceiling_sft_steps:
        if not args.save_rl_start:
            raise SystemExit("--ceiling-sft-steps needs --save-rl-start DIR (the copy is loaded from it)")
        twin = load(args.save_rl_start, cfg)
        out["ceiling_sft"] = sft(twin, tok, cfg, task=args.task2, steps=args.ceiling_sft_steps,
                                 lr=args.ceiling_sft_lr, global_batch=args.global_batch, how=how,
                                 heldout=args.held2, seq_len=args.seq)
        out["ceiling_sft"].pop("report")
        del twin
    return out


def grpo_optimizer(args, cfg, model, tok):
    """The GRPO optimizer and its scheduler (optionally primed with lr-0 SFT steps)."""
    grpo_steps = args.grpo_iterations * args.grpo_num_minibatches * args.grpo_ppo_epochs
    gocfg = options.build(OptimConfig, args, prefix="grpo",
                          decay_steps=grpo_steps - args.grpo_warmup_steps if args.grpo_cosine else None,
                          min_lr=args.grpo_lr / 100 if args.grpo_cosine else 0.0)
    opt = engine.build_optimizer(model.chunks, gocfg, cfg)
    if args.grpo_prime_sft:
        _set_lr(opt, 0.0)
        prime = data.batches(sft_pairs(args.task2), tok, seq_len_tokens=args.seq, global_batch=args.global_batch)
        for _ in range(args.grpo_prime_sft):
            train_step(model.chunks, opt, next(prime), options=options.build(StepOptions, args, prefix=""))
    return opt, engine.build_scheduler(opt, gocfg, total_steps=grpo_steps)


def run_grpo(args, rt, cfg, model, tok, src: str) -> dict:
    """GRPO from the current model; held-out accuracy (greedy and sampled) along the way."""
    from transformers import AutoModelForCausalLM
    rollout = grpo.Rollout(AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype(args.dtype)).to(rt.device), tok,
                           config=DecodeConfig(weights=args.rollout_weights))
    per_rank = args.grpo_prompts_per_iteration * args.grpo_samples_per_prompt // args.grpo_num_minibatches // rt.dp_size  # sequences/rank/update
    grpo_cfg = options.build(grpo.GRPOConfig, args, prefix="grpo", max_new_tokens=args.rl_digits + 3,
                             micro_batch_size=min(args.grpo_micro_batch_size or args.micro_batch_size, per_rank))
    opt, sched = grpo_optimizer(args, cfg, model, tok)
    ref = None
    if args.grpo_kl_coef:
        if not args.save_rl_start:
            raise SystemExit("--grpo-kl > 0 needs --save-rl-start DIR (the frozen reference is loaded from it)")
        ref = load(args.save_rl_start, cfg).chunks

    def heldout(it: int) -> tuple:
        greedy = generate.evaluate(model.chunks, tok, args.held2, reward_fn=data.verify)["accuracy"]
        sampled = None
        if args.grpo_eval_samples:
            sampled = sampled_accuracy(rollout, model, args.held2, samples=args.grpo_eval_samples,
                                       temperature=args.grpo_temperature, max_new_tokens=grpo_cfg.max_new_tokens,
                                       seed=10_000_019 * (it + 1))
        if rt.rank == 0:
            print(f"\n  held-out after {it} iterations: greedy {greedy:.3f}"
                  + ("" if sampled is None else f", sampled {sampled:.3f}"), flush=True)
        return it, greedy, sampled

    curve = [heldout(0)]

    def on_iteration(it, _metrics):
        if args.grpo_eval_every and (it + 1) % args.grpo_eval_every == 0 and it + 1 < args.grpo_iterations:
            curve.append(heldout(it + 1))

    t0 = time.perf_counter()
    pool = args.task2.rl_prompts(4000 if args.rl_digits >= 2 else 90)
    hist = grpo.fit(chunks=model.chunks, optimizer=opt, bridge=model.bridge, rollout=rollout, prompt_pool=pool,
                    reward_fn=data.REWARDS[args.grpo_reward], cfg=grpo_cfg, iterations=args.grpo_iterations,
                    seq_len_tokens=args.seq, ref_chunks=ref, on_iteration=on_iteration, scheduler=sched)
    seconds = time.perf_counter() - t0
    curve.append(heldout(args.grpo_iterations))
    median_sync = _median(hist.sync_s)
    return dict(seconds=seconds, heldout_curve=curve, grpo=vars(hist), median_sync_s=median_sync,
                sync_gbps=hist.sync_bytes[0] / median_sync / 1e9)


def _median(xs: list[float]) -> float:
    """The upper median (for even lengths the larger middle value, as in the numbers already in the docs)."""
    return sorted(xs)[len(xs) // 2]


def report(args, rt, res: dict) -> None:
    """Prints the SFT and GRPO results (rank 0)."""
    s1, s2, ceiling = res["sft"], res["rl_sft"], res["ceiling_sft"]
    if s1 is not None:
        print(f"\nSFT {args.sft_digits}-digit addition, size {args.size}, {args.dtype}, world {rt.world_size}:")
        print(f"  {s1['steps']} steps in {s1['seconds']:.1f} s; loss {s1['loss_first']:.3f} -> {s1['loss_last']:.3f};"
              f" held-out exact match {s1['accuracy_before']:.3f} -> {s1['accuracy_after']:.3f} (target >= 0.90)")
        print(format_table({"FSDP": s1["report"]}, dtype=args.dtype))
    print(f"\n{args.rl_digits}-digit addition, size {args.size}, {args.dtype}, world {rt.world_size}: short SFT "
          f"({s2['steps']} steps, {s2['seconds']:.1f} s, held-out by round {s2['accuracy_by_round']}) "
          f"-> held-out {s2['accuracy_after']:.3f}")
    if ceiling is not None:
        print(f"  control: {ceiling['steps']} gold-data SFT steps (lr {args.ceiling_sft_lr:g}, cosine) from the "
              f"same start: held-out {ceiling['accuracy_before']:.3f} -> {ceiling['accuracy_after']:.3f}")
    if "grpo" not in res:
        return
    hist, curve = res["grpo"], res["heldout_curve"]
    (_, g0, p0), (_, g1, p1) = curve[0], curve[-1]
    sampled = "" if p0 is None else f"; sampled {p0:.3f} -> {p1:.3f} ({100 * (p1 - p0):+.1f})"
    print(f"  {args.grpo_iterations} GRPO iterations ({res['seconds']:.1f} s): held-out greedy {g0:.3f} -> {g1:.3f} "
          f"({100 * (g1 - g0):+.1f} points; target >= +10){sampled}")
    print(f"  {args.grpo_prompts_per_iteration} prompts x {args.grpo_samples_per_prompt} samples, {args.grpo_num_minibatches} minibatches x "
          f"{args.grpo_ppo_epochs} epochs, lr {args.grpo_lr:g} (warm-up {args.grpo_warmup_steps}, "
          f"{'cosine' if args.grpo_cosine else 'constant'}, prime-sft {args.grpo_prime_sft}, "
          f"eps {args.grpo_adam_eps:g}, beta2 {args.grpo_adam_beta2:g}, clip {args.grpo_clip_grad:g}), "
          f"kl {args.grpo_kl_coef:g}, T {args.grpo_temperature:g}, reward {args.grpo_reward}, "
          f"min advantage {args.grpo_min_advantage}")
    print("  held-out by iteration (greedy/sampled):",
          " ".join(f"{i}:{g:.3f}/{'-' if p is None else f'{p:.3f}'}" for i, g, p in curve))
    print("  reward per iteration:", " ".join(f"{r:.3f}" for r in hist["reward"]))
    print("  train-rollout |dlogp| mean per iteration:", " ".join(f"{r:.4f}" for r in hist["logprob_diff_mean"]))
    print("  exact-match rate of samples:", " ".join(f"{r:.3f}" for r in hist["accuracy"]))
    print(f"  sync per iteration: median {res['median_sync_s'] * 1e3:.1f} ms for {hist['sync_bytes'][0] / 1e6:.1f} MB "
          f"-> {res['sync_gbps']:.2f} GB/s; rollout median {_median(hist['rollout_s']):.3f} s; "
          f"train median {_median(hist['train_s']):.3f} s")


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    cfg = EngineConfig(use_megatron_fsdp=True, dtype=args.dtype, seed=0)
    rt = runtime.init(cfg)
    src = args.init_from or f"/tmp/mfsdp_sft_grpo_{args.size}"
    if rt.rank == 0 and not args.init_from:
        tiny(src, size=args.size, seed=0)
    dist.barrier()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(src)
    model = load(src, cfg)
    args.seq = 4 * max(args.sft_digits, args.rl_digits) + 8
    args.task2 = data.ArithmeticTask(digits=args.rl_digits)
    args.held2 = args.task2.rl_prompts(min(args.heldout, 10) if args.rl_digits == 1 else args.heldout,
                                       split="heldout")
    res = sft_stages(args, cfg, model, tok)
    if args.grpo_iterations:
        res.update(run_grpo(args, rt, cfg, model, tok, src))
    if rt.rank == 0:
        report(args, rt, res)
        print(f"  total wall time {time.perf_counter() - t_start:.1f} s")
        saved = {k: v for k, v in vars(args).items() if k not in ("task2", "held2")}
        write_json(args.out, dict(args=saved, **res), default=lambda report: report.as_dict())
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
