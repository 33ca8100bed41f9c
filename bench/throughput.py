"""Throughput, MFU and memory per GPU: megatron DDP vs Megatron-FSDP vs PyTorch FSDP2, one run.

    torchrun --nproc_per_node 2 bench/throughput.py --spec 1.7b --attention sdpa \\
        --micro-batch-size 4 --global-batch 16 --steps 8 --warmup 2 --out runs/bench/throughput.json
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/throughput.py --spec tiny --steps 3   # CPU

All modes train the SAME megatron GPT (local spec, same attention backend, seed, batches):
- ddp:   megatron DistributedDataParallel + distributed optimizer (ZeRO-1), bf16 Float16Module;
- fsdp:  Megatron-FSDP, optim_grads_params (ZeRO-3) + `--fsdp-overrides`;
- fsdp2: torch `fully_shard` per TransformerLayer then the root, MixedPrecisionPolicy(bf16
         params, fp32 reduce), torch AdamW (fused on GPU) on the fp32 sharded params.
Each mode runs in turn in the same processes; memory is freed between modes and an OOM (or
any error) is recorded for that mode and the next one runs.

FLOPs per token (MFU, not HFU: recompute is not counted), PaLM's accounting:
    6 * N  +  12 * L * H * S
    N = parameters that take part in a matmul = transformer layers + final norm + output
        layer (H * V); the input embedding table is a lookup and is EXCLUDED.
    12 * L * H * S = attention scores and weighted sum (2 matmuls * 2 FLOP * S * H per token
        per layer, x3 for forward + backward), full S x S (causal masking not discounted).
    MFU = tokens/s/GPU * FLOPs per token / 989e12 (H100/H200 dense bf16 peak).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import traceback

import torch
import torch.distributed as dist

from mfsdp_kit import engine, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.data import random_token_batches
from mfsdp_kit.memory import memory_report, zero_formula_bytes
from mfsdp_kit.models import GPTSpec, gpt_model_fn
from mfsdp_kit.train import Batch, step

PEAK_FLOPS_PER_GPU = 989e12  # H100/H200 SXM, dense bf16
SPECS = {
    "tiny": GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                    vocab_size=128, seq_len_tokens=32),
    # 24 * (4 * 2048^2 + 3 * 2048 * 5632) = 1.23 B in layers + 2 * 32768 * 2048 = 0.13 B embeddings
    "1.7b": GPTSpec(num_layers=24, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632,
                    vocab_size=32768, seq_len_tokens=2048),
    # 26 * (4 * 3072^2 + 3 * 3072 * 8192) = 2.94 B + 0.20 B embeddings
    "3b": GPTSpec(num_layers=26, hidden_size=3072, num_attention_heads=24, ffn_hidden_size=8192,
                  vocab_size=32768, seq_len_tokens=2048),
    # Llama-2-7B shape: 32 * (4 * 4096^2 + 3 * 4096 * 11008) = 6.48 B + 0.27 B embeddings
    "7b": GPTSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                  vocab_size=32768, seq_len_tokens=2048),
}
MODES = ("ddp", "fsdp", "fsdp2")


def matmul_params(spec: GPTSpec) -> int:
    """N of the FLOP formula: every parameter except the input embedding table."""
    return spec.param_count() - spec.vocab_size * spec.hidden_size


def flops_per_token(spec: GPTSpec) -> int:
    return 6 * matmul_params(spec) + 12 * spec.num_layers * spec.hidden_size * spec.seq_len_tokens


def batches(spec: GPTSpec, *, n: int, global_batch: int, seed: int = 0) -> list[Batch]:
    return random_token_batches(steps=n, global_batch=global_batch, seq_len_tokens=spec.seq_len_tokens,
                                vocab_size=spec.vocab_size, seed=seed)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _engine_config(args, mode: str) -> EngineConfig:
    on_gpu = torch.cuda.is_available()
    return EngineConfig(
        use_megatron_fsdp=mode == "fsdp", dtype=args.dtype, attention_backend=args.attention,
        recompute=args.recompute, seed=1234,
        override_ddp_config=json.loads(args.fsdp_overrides if mode == "fsdp" else args.ddp_overrides),
        # Initialise on the GPU: CPU init of billions of parameters takes minutes.
        override_transformer_config=dict(use_cpu_initialization=False) if on_gpu else {})


# ---- megatron DDP / Megatron-FSDP ------------------------------------------------------------
def run_megatron(cfg: EngineConfig, spec: GPTSpec, data: list[Batch], args) -> dict:
    chunks = engine.build(cfg, gpt_model_fn(spec, cfg))
    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-4, clip_grad=1.0), cfg)
    times, losses = [], []
    for i, b in enumerate(data):
        _sync()
        t0 = time.perf_counter()
        r = step(chunks, opt, b, micro_batch_size=args.micro_batch_size, step_index=i)
        _sync()
        times.append(time.perf_counter() - t0)
        losses.append(r.loss)
    report = memory_report(chunks, opt).as_dict()
    del chunks, opt
    return dict(times=times, losses=losses, memory=report)


# ---- PyTorch FSDP2 baseline ------------------------------------------------------------------
def run_fsdp2(cfg: EngineConfig, spec: GPTSpec, data: list[Batch], args) -> dict:
    from megatron.core import tensor_parallel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    rt = runtime.current()
    model = gpt_model_fn(spec, cfg)(pre_process=True, post_process=True)
    for p in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    model = model.float().to(rt.device)  # fp32 master weights; FSDP2 casts to bf16 per unit
    compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.dtype]
    mesh = init_device_mesh(rt.device.type, (rt.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                            fused=rt.device.type == "cuda")
    times, losses = [], []
    for b in data:
        _sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        losses.append(_fsdp2_forward_backward(model, b, args.micro_batch_size, rt))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        _sync()
        times.append(time.perf_counter() - t0)
    memory = _fsdp2_memory(model, opt, spec)
    del model, opt
    return dict(times=times, losses=losses, memory=memory)


def _fsdp2_forward_backward(model, batch: Batch, micro_batch_size: int, rt) -> float:
    """Per-token mean over the global batch, as train.step: sum / global tokens, grads averaged
    over ranks by FSDP2, hence the * world_size."""
    n = batch.num_sequences // rt.world_size
    local = batch.slice(rt.rank * n, (rt.rank + 1) * n).to(rt.device)
    global_tokens = batch.loss_mask.sum().item()
    total = torch.zeros(2, dtype=torch.float64, device=rt.device)
    for i in range(0, n, micro_batch_size):
        mb = local.slice(i, i + micro_batch_size)
        pos = torch.arange(mb.tokens.shape[1], device=rt.device).unsqueeze(0).expand_as(mb.tokens)
        per_token = model(mb.tokens, pos, None, labels=mb.labels)
        loss_sum = (per_token.float() * mb.loss_mask).sum()
        (loss_sum * rt.world_size / global_tokens).backward()
        total += torch.stack([loss_sum.detach().double(), mb.loss_mask.sum().double()])
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def _fsdp2_memory(model, opt, spec: GPTSpec) -> dict:
    """The same fields as memory.memory_report: fp32 sharded params (= main weights), fp32 grads, moments."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    params = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    grads = sum(local(p.grad).numel() * local(p.grad).element_size() for p in model.parameters() if p.grad is not None)
    states = sum(local(v).numel() * local(v).element_size() for s in opt.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.numel() > 1)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    model_state = params + grads + states
    return dict(params_bytes=params, grads_bytes=grads, main_params_bytes=0, optimizer_states_bytes=states,
                activations_peak_bytes=max(peak - model_state, 0), num_params=spec.param_count(),
                dp_size=dist.get_world_size(), model_state_bytes=model_state)


# ---- one mode, guarded ----------------------------------------------------------------------
def run_mode(mode: str, spec: GPTSpec, data: list[Batch], args) -> dict:
    cfg = _engine_config(args, mode)
    rt = runtime.init(cfg, timeout_s=args.timeout_s)
    _free()
    result, error = None, None
    try:
        fn = run_fsdp2 if mode == "fsdp2" else run_megatron
        result = fn(cfg, spec, data, args)
    except torch.OutOfMemoryError as e:
        error = f"OOM: {str(e).splitlines()[0]}"
    except Exception as e:  # noqa: BLE001 - a failing mode must not hide the others
        error = f"{type(e).__name__}: {str(e)[:500]}"
        if rt.rank == 0:
            traceback.print_exc()
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    runtime.shutdown()
    _free()
    if error is not None:
        return dict(mode=mode, error=error, peak_bytes=peak)
    measured = result["times"][args.warmup:] or result["times"]
    step_s = statistics.median(measured)
    tokens_per_s_gpu = len(data[0].tokens) * spec.seq_len_tokens / step_s / rt.world_size
    mem = result["memory"]
    formula = zero_formula_bytes(num_params=spec.param_count(), dp_size=rt.dp_size, fsdp=mode != "ddp",
                                 dtype=args.dtype)
    return dict(mode=mode, step_s=step_s, step_times_s=result["times"], losses=result["losses"],
                tokens_per_s_per_gpu=tokens_per_s_gpu,
                mfu=tokens_per_s_gpu * flops_per_token(spec) / PEAK_FLOPS_PER_GPU,
                peak_bytes=peak, memory=mem, zero_formula_bytes=formula,
                model_state_vs_16_bytes_per_param=mem["model_state_bytes"] / (16 * spec.param_count() / rt.dp_size))


# ---- report --------------------------------------------------------------------------------
def _row(name: str, results: dict, fmt) -> str:
    return f"{name:<30}" + "".join(f"{fmt(results[m]) if 'error' not in results[m] else '-':>14}" for m in results)


def print_report(results: dict, spec: GPTSpec, args, world: int) -> None:
    big = spec.param_count() > 1e8
    gib, unit = (2**30, "GiB") if big else (2**20, "MiB")
    scale, pu = (1e9, "B") if big else (1e6, "M")
    print(f"\n{args.spec}: {spec.param_count() / scale:.3f} {pu} params (N for FLOPs = {matmul_params(spec) / scale:.3f} {pu}, "
          f"input embedding excluded), L={spec.num_layers} H={spec.hidden_size} S={spec.seq_len_tokens}, "
          f"{args.dtype}, attention={args.attention}, recompute={args.recompute}, world={world}, "
          f"micro-batch {args.micro_batch_size}, global batch {args.global_batch} x {spec.seq_len_tokens} tokens")
    print(f"FLOPs/token = 6*N + 12*L*H*S = {flops_per_token(spec) / 1e9:.2f} GFLOP; "
          f"MFU peak {PEAK_FLOPS_PER_GPU / 1e12:.0f} TFLOP/s/GPU (bf16 dense H100/H200)")
    print(f"{'':<30}" + "".join(f"{m:>14}" for m in results))
    print(_row("step s (median)", results, lambda r: f"{r['step_s']:.4f}"))
    print(_row("tokens/s/GPU", results, lambda r: f"{r['tokens_per_s_per_gpu']:,.0f}"))
    print(_row("MFU %", results, lambda r: f"{100 * r['mfu']:.1f}"))
    print(_row(f"peak {unit}/GPU", results, lambda r: f"{r['peak_bytes'] / gib:.2f}"))
    print(_row(f"model state {unit}/GPU", results, lambda r: f"{r['memory']['model_state_bytes'] / gib:.3f}"))
    print(_row("  / (16 B * params / dp)", results, lambda r: f"{r['model_state_vs_16_bytes_per_param']:.3f}"))
    print(_row(f"ZeRO formula {unit}/GPU", results, lambda r: f"{r['zero_formula_bytes'] / gib:.3f}"))
    print(_row("loss first -> last", results, lambda r: f"{r['losses'][0]:.3f}>{r['losses'][-1]:.3f}"))
    ref = next((r for r in results.values() if "error" not in r), None)
    if ref is not None:  # same seed, init and batches: the modes differ only by rounding
        print(_row(f"max|loss - {ref['mode']}|", results,
                   lambda r: f"{max(abs(a - b) for a, b in zip(r['losses'], ref['losses'])):.2e}"))
    for m, r in results.items():
        if "error" in r:
            print(f"{m}: FAILED {r['error']}")
    print("\ntargets (GPU, 1.7b on 2 GPUs):")
    for line in targets(results):
        print("  " + line)


def targets(results: dict) -> list[str]:
    ok = lambda m: m in results and "error" not in results[m]  # noqa: E731
    lines = []
    if ok("fsdp"):
        f = results["fsdp"]
        lines.append(f"FSDP MFU {100 * f['mfu']:.1f} %  (target >= 50 %)  {'PASS' if f['mfu'] >= 0.5 else 'MISS'}")
        ratio = f["model_state_vs_16_bytes_per_param"]
        lines.append(f"FSDP model state / (16 B/param / dp) = {ratio:.3f}  (target within 10 %)  "
                     f"{'PASS' if abs(ratio - 1) <= 0.10 else 'MISS'}")
        for other, goal in (("fsdp2", 1.05), ("ddp", 1.0)):
            if ok(other):
                x = f["tokens_per_s_per_gpu"] / results[other]["tokens_per_s_per_gpu"]
                lines.append(f"FSDP / {other.upper()} throughput {x:.3f}x  (target >= {goal}x)  "
                             f"{'PASS' if x >= goal else 'MISS'}")
        if ok("fsdp2"):
            a, b = f["peak_bytes"], results["fsdp2"]["peak_bytes"]
            lines.append(f"FSDP peak {a / 2**30:.2f} GiB vs FSDP2 {b / 2**30:.2f} GiB  (target FSDP <= FSDP2)  "
                         f"{'PASS' if a <= b else 'MISS'}")
    return lines


def main() -> None:
    on_gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="1.7b" if on_gpu else "tiny", choices=list(SPECS))
    ap.add_argument("--attention", default="sdpa", choices=["local", "sdpa"])
    ap.add_argument("--dtype", default="bf16" if on_gpu else "fp32", choices=["bf16", "fp32"])
    ap.add_argument("--micro-batch-size", type=int, default=4 if on_gpu else 2)
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: mbs * world)")
    ap.add_argument("--steps", type=int, default=8, help="measured steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    ap.add_argument("--modes", default="ddp,fsdp,fsdp2")
    ap.add_argument("--fsdp-overrides", default='{"overlap_param_gather": true}',
                    help="JSON for EngineConfig.override_ddp_config in the fsdp mode")
    ap.add_argument("--ddp-overrides", default='{"overlap_grad_reduce": true}',
                    help="JSON for EngineConfig.override_ddp_config in the ddp mode")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--out", default="runs/bench/throughput.json")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            ap.error(f"--modes: {m!r} is not one of {', '.join(MODES)}")
    spec = SPECS[args.spec]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args.global_batch = args.global_batch or args.micro_batch_size * world
    if args.global_batch % (args.micro_batch_size * world):
        ap.error(f"--global-batch {args.global_batch} must be a multiple of micro-batch * world = "
                 f"{args.micro_batch_size * world}")
    data = batches(spec, n=args.warmup + args.steps, global_batch=args.global_batch)
    results = {m: run_mode(m, spec, data, args) for m in modes}
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        print_report(results, spec, args, world)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), spec=vars(spec), params=spec.param_count(),
                           matmul_params=matmul_params(spec), flops_per_token=flops_per_token(spec),
                           peak_flops_per_gpu=PEAK_FLOPS_PER_GPU, world=world, results=results,
                           targets=targets(results)), f, indent=1)
        print("wrote", args.out)
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
