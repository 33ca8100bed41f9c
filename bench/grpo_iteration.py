"""One GRPO iteration at research scale on one GPU, and where its time goes: HF `generate` against the kit's
rollout engine (`rl.rollout.ContinuousRollout`), the same model, prompts and seeds.

    python bench/grpo_iteration.py --size l --iterations 3 --out runs/bench/grpo_iteration.json   # 1 GPU
    python bench/grpo_iteration.py --size xs --prompts 4 --samples 2 --max-new-tokens 16 --iterations 1  # CPU
    python bench/grpo_iteration.py --shape qwen2.5-7b --lora-rank 16 --prompts 32 --samples 8 --max-new-tokens 1024

--shape: instead of a tiny model, a real architecture's shape with random bf16 weights (`perf.hf_folder`, the seed's
Qwen2.5-7B), given the tiny model's tokenizer (its ids are a small corner of the vocabulary; an untrained model
rarely samples its stop id, so completions run to --max-new-tokens: the worst case). --lora-rank r: LoRA of rank r
(alpha 2r) on every linear, the base frozen; the rollout's refresh merges W + s B A in the sync plan.
--partial-fraction f --max-staleness s (GRPOConfig's, as every field is an option): partial rollouts (`rl.partial`);
the history then has each iteration's staleness histogram and rows carried. A budget past 1,024 - 128 new tokens
writes the tiny model with room for it (`positions_for`).

The setting of issue 37: the tiny `l` model (1.7 B, bf16, Megatron-FSDP), untrained, so its responses run long
(written with 1024 positions for that), 64 prompts x 8 samples of the 3-digit arithmetic
task, up to 512 new tokens at T 1. Each iteration is split into sync (weights into the rollout model), rollout,
logprob (old log-probs) and update seconds (`rl.loop.History`), with the mean response length and the
train-inference log-prob mismatch, and the seconds torch.compile took in each iteration (`compile_s`) and what the kit's
Triton kernels compiled in it (`triton_compiles`: seconds, kernels, disk-cache loads), and the token budgets and the
allocator's retries after it (`memory`). Prints a table
per backend and writes JSON; `plots.iteration_time` draws it.

FP8 rollout weights against bf16 (issue 72): `--backends continuous,continuous_fp8 --rollout-correction token-truncate`
records per iteration each one's train-rollout log-prob mismatch (`logprob_diff_mean`/`_max`), the correction's
weights and the reward, in the same history fields (the reward curve of a model that learns: bench/sft_grpo.py
`--rollout-weights fp8`).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from mfsdp_kit.train import data, token_budget
from mfsdp_kit.notebook import plots
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import ConfigError, EngineConfig, Kernels, OptimConfig, Wrapper
from mfsdp_kit.lora import LoRAConfig
from mfsdp_kit.distributed.introspect import torch_dtype
from mfsdp_kit.models.hf import load
from mfsdp_kit.models.tiny import tiny
from mfsdp_kit.perf import compile_time, floors, options
from mfsdp_kit.perf.report import write_json
from mfsdp_kit.rl import grpo
from mfsdp_kit.rl.rollout import ContinuousRollout, DecodeConfig, HFRollout

SPLIT = ("sync_s", "rollout_s", "logprob_s", "update_s")
DECODE = dict(continuous_torch=dict(kernels="torch"), continuous_eager=dict(kernels="torch", compile_glue=False),
              continuous_triton=dict(kernels="triton"), continuous_freed=dict(keep_cache=False),
              continuous_serial=dict(compile_ahead=False), continuous_pow2=dict(buckets_per_doubling=1),
              continuous_sampler=dict(sampler="triton"), continuous_fused_rope=dict(fuse_rope=True),
              continuous_fp8=dict(weights="fp8"))
"""Each `--backends` name's DecodeConfig fields besides the defaults ("continuous": none)."""


def shape_folder(shape: str, *, root: str) -> Path:
    """`shape`'s folder with random bf16 weights (`perf.hf_folder.write_for_world`) and the tiny model's tokenizer."""
    import shutil
    from mfsdp_kit.perf.hf_folder import write_for_world
    path, _ = write_for_world(f"mfsdp_grpo_iteration_{shape}", shape, root=root, shard_gb=4.0)
    tokenizer = model_folder("xs", positions=1024)
    if runtime.current().rank == 0:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (Path(tokenizer) / name).is_file():
                shutil.copy(Path(tokenizer) / name, path / name)
    dist.barrier()
    return path


def positions_for(max_new_tokens: int) -> int:
    """Rotary positions of the tiny model: 1024 (the issue-37 setting), or prompt room above a longer budget."""
    return max(1024, -(-(max_new_tokens + 128) // 256) * 256)


def model_folder(size: str, *, positions: int) -> str:
    """A tiny model of `size` written once per run on rank 0, with `positions` rotary positions."""
    src = f"/tmp/mfsdp_grpo_iteration_{size}"
    if runtime.current().rank == 0:
        tiny(src, size=size, seed=0, positions=positions)
    dist.barrier()
    return src


def split_table(name: str, result: dict, cfg, *, params: int, hw: floors.Hardware, lora: bool = False) -> list[dict]:
    """Print one backend's per-iteration split with each pass's floor on `hw` (`perf.floors`) and its MFU on real
    tokens (with `lora`, the update's floor at 4N FLOPs a token: the frozen base needs no weight gradients); returns
    the rows (seconds, floors, MFU) for the JSON."""
    rows = []
    print(f"\n{name}: {cfg.prompts_per_iteration} prompts x {cfg.samples_per_prompt} samples, "
          f"<= {cfg.max_new_tokens} new tokens, {params / 1e9:.2f} B params; floor ({hw.name}) / MFU beside each "
          f"pass (MFU: model FLOPs of real tokens / 989 TFLOP/s)")
    print(f"{'it':>3} " + " ".join(f"{k[:-2]:>17}" for k in SPLIT) + f" {'total s':>8} {'resp tok':>8} "
          f"{'|dlogp| mean':>12} {'tail s':>7}")
    samples = cfg.prompts_per_iteration * cfg.samples_per_prompt
    engines = [result["engine"][i] if i < len(result["engine"]) else {} for i in range(len(result["rollout_s"]))]
    steps = [e.get("steps", longest) for e, longest in zip(engines, result["response_tokens_max"])]
    per_iteration = floors.rl_iterations(SimpleNamespace(**result), params=params, hw=hw, samples=samples,
                                         decode_steps=steps, lora=lora)   # the engine's decode steps where known
    for i, (stats, floor) in enumerate(zip(engines, per_iteration)):
        split = {k: result[k][i] for k in SPLIT}
        tail = sum(v["seconds"] for b, v in stats.get("by_batch", {}).items() if int(b) < 64)
        mfu = {k: floors.mfu(split[k], floor[k], hw) for k in ("logprob_s", "update_s") if floor[k] > 0}
        print(f"{i:>3} " + " ".join(f"{split[k]:>6.2f} ({floor[k]:.2f}" + (f" {100 * mfu[k]:>3.0f}%)" if k in mfu
                                                                          else "     )") for k in SPLIT) +
              f" {sum(split.values()):>8.2f} {result['response_tokens'][i]:>8.1f} "
              f"{result['logprob_diff_mean'][i]:>12.4f} {tail:>7.2f}")
        if result.get("compile_s"):
            triton = result["triton_compiles"][i]
            print(f"     torch.compile: {result['compile_s'][i]:.2f} s of the iteration; the kit's Triton kernels: "
                  f"{triton['seconds']:.2f} s, {triton['kernels']} compiled, {triton['cache_hits']} from the cache; "
                  f"other Triton compiles in this process: {triton['other_kernels']}, {triton['other_seconds']:.2f} s; "
                  f"the kit's by name: {triton.get('by_name', {})}")
        if result.get("memory"):
            m = result["memory"][i]
            per_token = m.get("train_bytes_per_token")
            print(f"     token budget: training {m['train_tokens']}, no-grad {m['forward_tokens']} tokens a "
                  f"micro-batch (measured {per_token / 1e6 if per_token else 0:.2f} MB a training token); "
                  f"allocator retries so far {m['alloc_retries']}, reserved {m['reserved_bytes'] / 2 ** 30:.1f} GiB, "
                  f"peak allocated {m['peak_bytes'] / 2 ** 30:.1f} GiB")
        if stats:
            print("     engine: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                           for k, v in stats.items() if k != "by_batch"))
            print("     by batch (steps, s): " + ", ".join(f"{b}: {v['steps']} {v['seconds']:.2f}"
                                                        for b, v in stats.get("by_batch", {}).items()))
        rows.append(dict(iteration=i, seconds=split, total_s=sum(split.values()), floors=floor,
                         mfu=mfu, tail_s=tail))
    return rows


def memory_state(*, chunks, gpu: bool) -> dict:
    """After an iteration: the packed passes' token budgets (`train.token_budget.memory_budget`: training and no-grad,
    tokens per micro-batch) and the training pass's measured peak bytes per token; on a GPU the allocator's retries
    so far (a cudaMalloc that failed, then freed cached blocks and tried again: a sync each), its reserved bytes,
    and the iteration's peak of allocated bytes (the peak is reset after each read, so each iteration has its own)."""
    budget = token_budget.decided_budgets(chunks)
    stats = torch.cuda.memory_stats() if gpu else {}
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    return dict(train_tokens=budget.get(False), forward_tokens=budget.get(True),
                train_bytes_per_token=token_budget.measured_bytes_per_token(chunks),
                alloc_retries=stats.get("num_alloc_retries", 0),
                reserved_bytes=stats.get("reserved_bytes.all.current", 0),
                peak_bytes=stats.get("allocated_bytes.all.peak", 0))


def profiled(history_fn, *, iterations: int):
    """Run `history_fn(on_iteration)` with torch.profiler recording the last iteration only (CUDA); returns
    (history, the last iteration's phase breakdown or None on CPU)."""
    from torch.profiler import ProfilerActivity, profile
    from mfsdp_kit.perf.kernel_mix import breakdown, format_breakdown
    from mfsdp_kit.perf.timeline import read_trace
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def start_last(i, _metrics):
        if i == iterations - 2:
            prof.start()
    history = history_fn(start_last if iterations > 1 else None)
    if iterations < 2:
        return history, None
    prof.stop()
    path = "/tmp/mfsdp_grpo_iteration_trace.json"
    prof.export_chrome_trace(path)
    rows = breakdown(read_trace(path))
    print("\nwhere the last iteration's time goes (s; host gap: no kernel running)")
    print(format_breakdown(rows))
    return history, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="l")
    p.add_argument("--shape", default="", help="a perf.hf_folder shape instead of --size (module docstring)")
    p.add_argument("--root", default="/dev/shm", help="where --shape's folder is written (removed at the end)")
    p.add_argument("--init-from", default="", help="an HF folder to start from instead of --size (e.g. one "
                                                   "bench/sft_grpo.py --save-rl-start wrote: rewards that move)")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA of this rank on every linear (0: full fine-tuning)")
    p.add_argument("--iterations", type=int, default=3)
    options.add_options(p, grpo.GRPOConfig, prefix="", names=dict(prompts_per_iteration="prompts",
                                                                  samples_per_prompt="samples"),
                        defaults=dict(prompts_per_iteration=64, samples_per_prompt=8, max_new_tokens=512))
    p.add_argument("--backends", default="hf,continuous",
                   help="hf, continuous (the default DecodeConfig: cache and graphs kept, kernels 'auto'), "
                        "continuous_freed (freed after each call), continuous_torch (the decode step in torch ops: "
                        "`kernels='torch'`, SDPA and compiled glue), continuous_eager (the same, its glue not "
                        "compiled: `compile_glue=False`), continuous_triton (`kernels='triton'`), continuous_serial "
                        "(the Triton kernels compiled one by one at their first launch: `compile_ahead=False`), "
                        "continuous_pow2 (batch buckets the powers of two only: `buckets_per_doubling=1`), "
                        "continuous_sampler (the draw in one kernel: `sampler='triton'`), continuous_fused_rope "
                        "(RoPE and the cache write inside the attention kernel: `fuse_rope=True`), continuous_fp8 "
                        "(the projections' weights in FP8: `weights='fp8'`; refused by name off a GPU of sm89+)")
    p.add_argument("--fused-kernels", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                   help="EngineConfig.kernels.fused_kernels: auto (the default a user gets: on a GPU), on, off")
    p.add_argument("--fusion-kernels", default="auto", choices=("auto", "torch", "triton"),
                   help="EngineConfig.kernels.fusion_kernels: what computes the fused RoPE and SwiGLU (auto, the "
                        "default: Triton where it runs; torch.compile; the kit's Triton kernels)")
    p.add_argument("--keep-gathered", nargs="?", const="on", default="default", choices=("default", "on", "off"),
                   help="EngineConfig.wrapper.fsdp_keep_gathered: each FSDP unit gathered once a step (on), "
                        "again per micro-batch (off), or the kit's default")
    p.add_argument("--profile", action="store_true", help="profile the last iteration (kernel classes per pass)")
    p.add_argument("--out", default="runs/bench/grpo_iteration.json")
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    keep = {} if args.keep_gathered == "default" else dict(fsdp_keep_gathered=args.keep_gathered == "on")
    cfg = EngineConfig(wrapper=Wrapper(use_megatron_fsdp=True, **keep), dtype="bf16" if gpu else "fp32", seed=0,
                       kernels=Kernels(fused_kernels={"on": True, "off": False}.get(args.fused_kernels, "auto"),
                                       fusion_kernels=args.fusion_kernels),
                       lora=LoRAConfig(rank=args.lora_rank, alpha=2 * args.lora_rank) if args.lora_rank else None)
    rt = runtime.init(cfg)
    src = (args.init_from or str(shape_folder(args.shape, root=args.root)) if args.shape or args.init_from
           else model_folder(args.size, positions=positions_for(args.max_new_tokens)))
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(src)
    model = load(src, cfg)
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-6), cfg)
    pool = data.ArithmeticTask(digits=3).rl_prompts(1000)
    hw = floors.hardware() or floors.HARDWARE["H200"]   # elsewhere (a CPU run): an H200's floors, so named
    grpo_cfg = options.build(grpo.GRPOConfig, args, prefix="")
    results = {}
    triton = compile_time.TritonCompiles().listen()   # the kit's Triton kernels' compiles, per iteration
    for name in args.backends.split(","):
        try:
            decode = DecodeConfig(**DECODE.get(name, {}))
        except ConfigError as e:   # continuous_fp8 off an sm89+ GPU: named in the JSON, the other backends still run
            results[name] = dict(refused=str(e))
            print(f"backend {name} refused: {e}")
            continue
        t0 = time.perf_counter()
        hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype(cfg.dtype)).to(rt.device)
        rollout = HFRollout(hf, tok) if name == "hf" else ContinuousRollout(hf, tok, config=decode)
        setup_s = time.perf_counter() - t0
        params = sum(p.numel() for n, p in hf.named_parameters() if "embed" not in n)
        engine_stats, compile_s, compiled = [], [], [compile_time.torch_compile_seconds()]
        triton_compiles, triton_read, memory = [], [triton.read()], []

        def run(on_iteration):
            def record(i, m):
                engine_stats.append(dict(getattr(rollout, "stats", {})))
                compiled.append(compile_time.torch_compile_seconds())
                compile_s.append(compiled[-1] - compiled[-2])
                triton_read.append(triton.read())
                triton_compiles.append(triton.since(before=triton_read[-2], after=triton_read[-1]))
                memory.append(memory_state(chunks=model.chunks, gpu=gpu))
                if on_iteration is not None:
                    on_iteration(i, m)
            return grpo.fit(chunks=model.chunks, optimizer=opt, bridge=model.bridge, rollout=rollout,
                            prompt_pool=pool, reward_fn=data.verify, cfg=grpo_cfg, iterations=args.iterations,
                            progress=False, on_iteration=record)
        history, phases = profiled(run, iterations=args.iterations) if args.profile and gpu else (run(None), None)
        results[name] = dict(vars(history), engine=engine_stats, compile_s=compile_s, triton_compiles=triton_compiles,
                             memory=memory, rollout_setup_s=setup_s, phases=phases)
        if rt.rank == 0:
            results[name]["table"] = split_table(name, results[name], grpo_cfg, params=params, hw=hw,
                                                  lora=bool(args.lora_rank))
            if gpu:   # the floors are an H200's
                plots.iteration_time(history, Path(args.out).with_name(f"grpo_iteration_{name}.png"),
                                     floors=[row["floors"] for row in results[name]["table"]])
        del rollout, hf
        torch.cuda.empty_cache() if gpu else None
    if rt.rank == 0:
        write_json(args.out, dict(args=vars(args), histories=results))
    if args.shape:
        from mfsdp_kit.perf.hf_folder import remove_for_world
        remove_for_world(Path(src), keep=False)
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
