"""The compute-side fusions one op at a time: megatron's kernels without Transformer Engine against the kit's.

    torchrun --nproc_per_node 1 bench/fusions.py --spec 1.7b --micro-batch-size 8 --out fusions.json

For each op of a training step that is neither a GEMM nor attention, at the shapes of `--spec` x micro-batch, in
bf16, per forward + backward: wall time of `--iters` calls back to back (host or GPU bound, whichever is slower),
the first call's seconds (its compile: torch.compile's, or Triton's unless its disk cache has the kernel), GPU
kernel time (torch.profiler), kernel time per step (calls per micro-batch x `--micro-batches`), the memory the
call holds above its inputs at its peak, and max |diff| of the output and the input gradient against megatron's
own function in fp32 on the same values.
- rope (q of one layer; k is the same shape without GQA): megatron's `_apply_rotary_pos_emb_bshd` eager, that
  function compiled whole (the kit's kernel until 2026-12-01), `models.fusions.rope`, and its Triton rotation
  (`kernels.fusion_kernels="triton"`, where Triton runs).
- cross_entropy (the logits of one micro-batch): megatron's unfused vocab-parallel one, its 'native' fusion
  (`cross_entropy_loss_fusion`), `models.cross_entropy` (`EngineConfig.kernels.fused_cross_entropy`).
- swiglu (one layer's gate/up output): SiLU(gate) * up eager, megatron's fused function (`bias_swiglu_impl`,
  torch.compile), the kit's Triton kernels (`kernels.fusion_kernels="triton"`, where Triton runs).
- rms_norm (one layer's input): torch's RMSNorm (megatron's local spec `WrappedTorchNorm`), and compiled.
On CPU (`--spec tiny`) the same rows run at toy shapes, for the test; the times then mean nothing.
"""
from __future__ import annotations

import argparse

import torch

from mfsdp_kit.distributed import runtime
from mfsdp_kit.config import EngineConfig
from mfsdp_kit.models import GPTSpec
from mfsdp_kit.models.gpt import SPECS
from mfsdp_kit.distributed import clock
from mfsdp_kit.perf.report import write_json

TINY = GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256,
               seq_len_tokens=32)


def _rope_cases(spec: GPTSpec, mb: int, device, dtype):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from mfsdp_kit.models import fusions
    head_dim = spec.hidden_size // spec.num_attention_heads
    g = torch.Generator().manual_seed(0)
    t = torch.randn(spec.seq_len_tokens, mb, spec.num_attention_heads, head_dim, generator=g).to(device, dtype)
    inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(spec.seq_len_tokens).float(), inv)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :].to(device)
    whole = torch.compile(_apply_rotary_pos_emb_bshd)
    cases = {"megatron eager": _apply_rotary_pos_emb_bshd, "megatron compiled whole": lambda x, f: whole(x, f),
             "kit (fusions.rope)": fusions.rope}
    if _triton_runs(device):
        cases["kit, Triton"] = lambda x, f: fusions.rope(x, f, kernels="triton")
    return cases, (t, freqs), _apply_rotary_pos_emb_bshd, 2 * spec.num_layers  # q and k in every layer


def _cross_entropy_cases(spec: GPTSpec, mb: int, device, dtype):
    from megatron.core import parallel_state as ps
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from mfsdp_kit.models.cross_entropy import cross_entropy
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(spec.seq_len_tokens, mb, spec.vocab_size, generator=g) * 2).to(device, dtype)
    target = torch.randint(0, spec.vocab_size, (spec.seq_len_tokens, mb), generator=g).to(device)
    tp = ps.get_tensor_model_parallel_group()
    cases = {"megatron unfused": vocab_parallel_cross_entropy,
             "megatron native fusion": lambda x, t: fused_vocab_parallel_cross_entropy(x, t, tp),
             "kit (cross_entropy)": lambda x, t: cross_entropy(x, t, group=tp)}
    return cases, (logits, target), vocab_parallel_cross_entropy, 1


def _rms_norm_cases(spec: GPTSpec, mb: int, device, dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(spec.seq_len_tokens, mb, spec.hidden_size, generator=g).to(device, dtype)
    norm = torch.nn.RMSNorm(spec.hidden_size, eps=1e-5).to(device, dtype)
    compiled = torch.compile(torch.nn.functional.rms_norm)
    reference = lambda x: torch.nn.functional.rms_norm(x, (x.shape[-1],), norm.weight.to(x.dtype), 1e-5)  # noqa: E731
    cases = {"torch RMSNorm": norm, "compiled": lambda x: compiled(x, (x.shape[-1],), norm.weight, 1e-5)}
    return cases, (x,), reference, 2 * spec.num_layers + 1


def _swiglu_cases(spec: GPTSpec, mb: int, device, dtype):
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    g = torch.Generator().manual_seed(3)
    ffn = spec.ffn_hidden_size or 4 * spec.hidden_size
    y = torch.randn(spec.seq_len_tokens, mb, 2 * ffn, generator=g).to(device, dtype)

    def eager(x):
        gate, up = x.chunk(2, -1)
        return torch.nn.functional.silu(gate) * up
    cases = {"megatron eager": eager, "megatron fused (compiled)": lambda x: bias_swiglu_impl(x, None)}
    if _triton_runs(device):
        from mfsdp_kit.models.triton_fusions import swiglu
        cases["kit, Triton"] = swiglu
    return cases, (y,), eager, spec.num_layers


def _triton_runs(device) -> bool:
    """Whether `kernels.fusion_kernels="triton"` can run on `device` (its rows are left out where not)."""
    from mfsdp_kit.models import fusions
    return fusions.triton_runs(on_gpu=torch.device(device).type == "cuda")


OPS = {"rope": _rope_cases, "swiglu": _swiglu_cases, "cross_entropy": _cross_entropy_cases,
       "rms_norm": _rms_norm_cases}


def _call(fn, x: torch.Tensor, rest: tuple, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward + backward of `fn` from the leaf `x`: (output, d(output . grad_out) / dx)."""
    out = fn(x, *rest)
    (grad,) = torch.autograd.grad(out, x, grad_outputs=grad_out)
    return out.detach(), grad


def _kernel_ms(run, *, calls: int) -> float | None:
    """GPU kernel time per call of `run` under torch.profiler (None without CUDA): what the op costs a step
    whose host keeps ahead of the GPU, which a back-to-back wall time of small kernels does not show."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        clock.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]
    return sum(e.device_time for e in kernels) / calls / 1e3


def measure(fn, inputs, reference, *, warmup: int, iters: int) -> dict:
    """Per forward + backward: the first no-grad forward's and forward + backward's seconds (their compile), wall ms
    (calls back to back), GPU kernel ms, MiB held above the inputs at the peak; max |diff| of output and input
    gradient against `reference` on the same values in fp32."""
    x, rest = inputs[0].detach().clone().requires_grad_(), inputs[1:]   # no case writes into its input in bf16
    ref_x = inputs[0].detach().float().requires_grad_()
    ref_rest = tuple(i.float() if i.is_floating_point() else i for i in rest)
    with torch.no_grad():   # an output gradient that weighs every output differently: every entry is checked
        shape = reference(ref_x.detach().clone(), *ref_rest).shape
    grad_out = torch.rand(shape, generator=torch.Generator().manual_seed(9)).to(x.device)
    ref_out, ref_grad = _call(reference, ref_x.detach().clone().requires_grad_(), ref_rest, grad_out)
    probe_s, out = clock.seconds(lambda: fn(x.detach(), *rest))   # a no-grad forward (the log-prob pass's)
    grad_out = grad_out.to(out.dtype)
    run = lambda: _call(fn, x, rest, grad_out)  # noqa: E731
    first_s = probe_s + clock.seconds(run)[0]   # the first calls compile (or load kernels from a disk cache)
    wall_ms = clock.mean_ms(run, repeats=iters, warmup=warmup)
    base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    out, grad = run()
    held = (torch.cuda.max_memory_allocated() - base) if torch.cuda.is_available() else 0
    return dict(first_s=first_s, ms=wall_ms, kernel_ms=_kernel_ms(run, calls=3), held_mib=held / 2**20,
                out_max_diff=(out.float() - ref_out).abs().max().item(),
                grad_max_diff=(grad.float() - ref_grad).abs().max().item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="1.7b", help="gpt.SPECS name, or 'tiny' (CPU test shapes)")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (for ms per step)")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ops = args.ops.split(",")
    if not set(ops) <= set(OPS):
        raise SystemExit(f"--ops: {args.ops!r} is not allowed; allowed: comma-separated of {', '.join(OPS)}")
    spec = TINY if args.spec == "tiny" else SPECS[args.spec]
    runtime.init(EngineConfig())
    device = runtime.current().device
    dtype = torch.bfloat16   # the training dtype these kernels are for; megatron's CE writes into fp32 inputs
    results = {}
    print(f"{'op':<14} {'implementation':<26} {'1st call s':>10} {'wall ms':>8} {'kernel ms':>9} {'calls/step':>10} {'kernel ms/step':>14} "
          f"{'held MiB':>9} {'max|out diff|':>13} {'max|grad diff|':>14}")
    for op in ops:
        cases, inputs, reference, per_mb = OPS[op](spec, args.micro_batch_size, device, dtype)
        calls = per_mb * args.micro_batches
        for name, fn in cases.items():
            r = dict(measure(fn, inputs, reference, warmup=args.warmup, iters=args.iters), calls_per_step=calls)
            per_call = r["kernel_ms"] if r["kernel_ms"] is not None else r["ms"]   # CPU: wall time only
            r["ms_per_step"] = per_call * calls
            results.setdefault(op, {})[name] = r
            kernel = f"{r['kernel_ms']:9.3f}" if r["kernel_ms"] is not None else f"{'-':>9}"
            print(f"{op:<14} {name:<26} {r['first_s']:10.3f} {r['ms']:8.3f} {kernel} {calls:10d} {r['ms_per_step']:14.2f} "
                  f"{r['held_mib']:9.1f} {r['out_max_diff']:13.2e} {r['grad_max_diff']:14.2e}")
    write_json(args.out, dict(args=vars(args), spec=vars(spec), device=str(device), results=results))
    runtime.shutdown()


if __name__ == "__main__":
    main()
