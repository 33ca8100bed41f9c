"""LoRA vs full fine-tuning on one GPU at a 7 B shape (issue 40): peak memory, tokens/s, optimizer state.

    torchrun --nproc_per_node 1 bench/lora.py --shape qwen2.5-7b --root /dev/shm --out runs/bench/lora.json
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 1 bench/lora.py --tiny --out /tmp/lora.json    # CPU smoke (gloo)

The folder is bench/load_hf.py's (`perf.hf_folder.write_folder`: Qwen2.5-7B's config.json, random bf16 weights in
safetensors shards), written under --root and removed at the end unless --keep. Each variant loads it through
`models.hf.load` into Megatron-FSDP, then runs --warmup + --steps optimizer steps on random tokens (--global-batch
sequences of --seq-len tokens, micro-batch --micro-batch-size):
    full   every weight trained
    lora   EngineConfig.lora = LoRAConfig(rank=--rank, alpha=2 x rank) on linear_qkv, linear_proj, linear_fc1 and
           linear_fc2 of every layer (all the linears; HF: q/k/v/o_proj, gate/up/down_proj)
Per variant: peak GiB (torch.cuda.max_memory_allocated over the run), tokens/s (the timed steps), and the
optimizer state per rank (`memory.memory_report`: fp32 main weights + Adam's two moments) against
    Megatron-FSDP keeps fp32 main weights in bf16 and fp32 alike: 4 main + 4 exp_avg + 4 exp_avg_sq
    = 12 B per trainable param / N ranks
    Qwen2.5-7B (7.62e9 params), full:  12 x 7.62e9 = 91.4 GB
    LoRA r=16 on every linear: 16 x (in + out) per linear, 28 layers x (qkv 16 x (3584 + 4608) + o 16 x 7168
    + gate/up 16 x (3584 + 37888) + down 16 x (18944 + 3584)) = 35.6e6 params -> 12 x 35.6e6 = 0.43 GB
and the model state per rank against `memory.zero_formula_bytes` (full) / `memory.lora_formula_bytes` (LoRA: the
frozen base's bf16 weights, 15.2 GB, plus the adapters' 16 B/param). Full fine-tuning's model state alone is
16 x 7.62e9 = 122 GB: it may not fit one GPU with activations; a variant that runs out of memory is reported as OOM.

The largest model LoRA trains on 1 GPU vs full fine-tuning is bench/max_model.py's search with
`--modes fsdp,fsdp-lora16` (the `fsdp-lora16` variant of perf.variants); gpu_sections' `lora` section runs both.
"""
from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from mfsdp_kit.train import data
from mfsdp_kit import lora, train
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import EngineConfig, Kernels, OptimConfig, Wrapper
from mfsdp_kit.distributed.memory import lora_formula_bytes, memory_report, zero_formula_bytes
from mfsdp_kit.models import hf as hf_models
from mfsdp_kit.distributed import clock
from mfsdp_kit.perf.hf_folder import SHAPES, hf_config, remove_for_world, write_for_world
from mfsdp_kit.perf import options
from mfsdp_kit.perf.peaks import guarded_run
from mfsdp_kit.perf.report import write_json

VARIANTS = ("full", "lora")
OPTIMIZER_BYTES_PER_PARAM = 12
"""Megatron-FSDP's optimizer state per trainable param: fp32 main weights 4 + exp_avg 4 + exp_avg_sq 4."""


def engine_config(variant: str, args) -> EngineConfig:
    spec = lora.LoRAConfig(rank=args.rank, alpha=2 * args.rank) if variant == "lora" else None
    return EngineConfig(wrapper=Wrapper(use_megatron_fsdp=True), kernels=Kernels(attention_backend=args.attention),
                        dtype=args.dtype, recompute=args.recompute, lora=spec)


def timed_steps(chunks, opt, args, *, vocab_size: int) -> dict:
    """--warmup then --steps steps; losses, seconds of the timed steps, tokens/s, peak bytes over all of them."""
    batches = data.random_token_batches(steps=args.warmup + args.steps, global_batch=args.global_batch,
                                        seq_len_tokens=args.seq_len, vocab_size=vocab_size)

    how = options.build(train.StepOptions, args, prefix="")

    def step(i: int):
        return train.step(chunks, opt, batches[i], options=how, step_index=i).loss

    losses = [step(i) for i in range(args.warmup)]
    with clock.timed() as t:   # the --steps after the warmup
        losses += [step(i) for i in range(args.warmup, len(batches))]
    seconds = t.seconds
    tokens = args.steps * args.global_batch * args.seq_len
    return dict(losses=losses, seconds=seconds, tokens_per_s=tokens / seconds,
                peak_bytes=torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0)


def refresh(model, path: Path, args) -> dict:
    """The rollout refresh of an RL iteration: `sync.load_into` an HF model of the same folder on this device, twice
    (the first builds the sync plan): seconds of the second, the plan's build, and tensors planned / left to the
    bridge (LoRA: the plan merges W + s B A itself where TP is 1)."""
    from transformers import AutoModelForCausalLM

    from mfsdp_kit.weights import sync as weight_sync
    from mfsdp_kit.distributed.introspect import torch_dtype
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(args.dtype)).to(runtime.current().device)
    first = weight_sync.load_into(hf, model.chunks, model.bridge)
    refresh_s, again = clock.seconds(lambda: weight_sync.load_into(hf, model.chunks, model.bridge))
    del hf
    return dict(refresh_s=refresh_s, refresh_first_s=first["seconds"], refresh_plan_s=first["plan_s"],
                refresh_planned=again["planned"], refresh_bridge=again["bridge"])


def formulas(variant: str, counts: dict, *, world: int, dtype: str) -> dict:
    """The optimizer state and the model state per rank the formulas predict (module docstring)."""
    trainable, frozen = counts["trainable"], counts["frozen"]
    state = (lora_formula_bytes(num_base_params=frozen, num_adapter_params=trainable, dp_size=world, fsdp=True,
                                dtype=dtype) if variant == "lora"
             else zero_formula_bytes(num_params=trainable + frozen, dp_size=world, fsdp=True, dtype=dtype))
    return dict(optimizer_formula_bytes=OPTIMIZER_BYTES_PER_PARAM * trainable // world, model_state_formula_bytes=state)


def train_variant(variant: str, path: Path, args, vocab_size: int, peaks) -> dict:
    """Runs inside `guarded_run` (a fresh runtime, an OOM caught as text)."""
    cfg = engine_config(variant, args)
    model = hf_models.load(path, cfg)
    counts = lora.param_counts(model.chunks)
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-5), cfg)
    result = timed_steps(model.chunks, opt, args, vocab_size=vocab_size)
    report = memory_report(model.chunks, opt)
    del opt   # Adam's moments (full fine-tuning: ~85 GB at 7 B) out of the way of the rollout model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    result.update(refresh(model, path, args))
    engine.release(model.chunks)
    return dict(result, **counts, **formulas(variant, counts, world=dist.get_world_size(), dtype=args.dtype),
                optimizer_state_bytes=report.main_params_bytes + report.optimizer_states_bytes,
                model_state_bytes=report.model_state_bytes)


def table(results: dict) -> str:
    gib = 2**30
    lines = [f"{'variant':<8}{'params':>15}{'trainable':>15}{'peak GiB':>10}{'tokens/s':>10}"
             f"{'optim GiB':>11}{'formula':>9}{'state GiB':>11}{'formula':>9}{'refresh s':>10}{'bridge':>7}  error"]
    for name, r in results.items():
        if r.get("error"):
            lines.append(f"{name:<8}{'':>83}  {r['error'][:80]}")
            continue
        lines.append(f"{name:<8}{r['trainable'] + r['frozen']:>15,}{r['trainable']:>15,}{r['peak_bytes'] / gib:>10.2f}"
                     f"{r['tokens_per_s']:>10.0f}{r['optimizer_state_bytes'] / gib:>11.3f}"
                     f"{r['optimizer_formula_bytes'] / gib:>9.3f}{r['model_state_bytes'] / gib:>11.2f}"
                     f"{r['model_state_formula_bytes'] / gib:>9.2f}{r['refresh_s']:>10.3f}{r['refresh_bridge']:>7}")
    return "\n".join(lines)


def parse(argv=None):
    on_gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: shape small, fp32, short sequences")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    ap.add_argument("--root", default="/dev/shm", help="where the folder is written (falls back to /tmp, runs/)")
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--dtype", default="bf16" if on_gpu else "fp32", choices=["bf16", "fp32"])
    ap.add_argument("--attention", default="sdpa" if on_gpu else "local", choices=["local", "sdpa"])
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=8)
    options.add_options(ap, train.StepOptions, prefix="", defaults=dict(micro_batch_size=1))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="keep the folder (default: removed at the end)")
    ap.add_argument("--out", default="runs/bench/lora.json")
    args = ap.parse_args(argv)
    if args.tiny:
        args.shape, args.dtype, args.attention, args.shard_gb = "small", "fp32", "local", 0.0002
        args.seq_len, args.global_batch, args.warmup, args.steps = 32, 2, 1, 2
    return args


def main() -> None:
    args = parse()
    runtime.init(engine_config("full", args))   # the world (nccl | gloo, the device set); each variant re-inits it
    config = hf_config(args.shape)
    path, write = write_for_world(f"mfsdp_lora_{args.shape}", args.shape, root=args.root, shard_gb=args.shard_gb)
    results = {}
    for variant in args.variants.split(","):
        run = partial(train_variant, variant, path, args, config.vocab_size)
        result, error, _, _ = guarded_run(engine_config(variant, args), run, timeout_s=600)
        results[variant] = dict(result or {}, error=error)
    if dist.get_rank() == 0:
        print(f"\n{args.shape}, {dist.get_world_size()} rank(s), Megatron-FSDP {args.dtype}, seq {args.seq_len}, "
              f"global batch {args.global_batch}, LoRA rank {args.rank}")
        print(table(results))
        write_json(args.out, dict(args=vars(args), world=dist.get_world_size(), write=write,
                                  device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                                  variants=results))
    remove_for_world(path, keep=args.keep)
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
