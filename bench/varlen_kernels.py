"""Attention kernels for one packed row, alone: agreement with an fp32 reference and TFLOP/s (issue #38).

    python bench/varlen_kernels.py --out runs/bench/varlen_kernels.json                 # GPU: every kernel
    python bench/varlen_kernels.py --heads 2 --head-dim 16 --budget 1200 --dtype fp32 --repeats 2 \\
        --out /tmp/vk.json                                                                # CPU

One row of the mix's sequences (`perf.length_mix`, as drawn, until the next would pass --budget tokens),
causal within each, [tokens, heads, head_dim]. Kernels:
- flash: torch's FlashAttention-2 varlen (`models.varlen.VarlenFlash`, what packed rows use on a GPU today);
- cudnn: cuDNN's ragged attention, `aten::_cudnn_attention_forward/_backward` with the row's cum_seq bounds
  (the nested-tensor path, backward through torch's own derivative of the op; not used by the model: on
  1 H200 with torch 2.11 it ran at 0.4 TFLOP/s with NaN dq/dk, docs/benchmarks.md); cudnn-i64 the same with
  int64 bounds (nested tensors' offsets are int64);
- per-sequence: one SDPA per sequence (`models.sdpa.per_sequence`, SDPAttention's path off the GPU; also the
  fp32 reference);
- dense: the same sequences padded to the longest and run through causal SDPA, what the padded path pays.
Reported per kernel: max |difference| from the fp32 per-sequence reference (output and the three input
gradients, on real tokens), forward and forward + backward ms, and TFLOP/s of the useful (causal, real-token)
FLOPs: forward 2 x 2 x sum(L^2)/2 x heads x head_dim, backward 2.5x that. A kernel that fails records its error
(prefixed by the direction that raised it).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from mfsdp_kit.models.sdpa import per_sequence
from mfsdp_kit.models.varlen import VarlenFlash
from mfsdp_kit.distributed import clock
from mfsdp_kit.perf import length_mix
from mfsdp_kit.perf.report import write_json

KERNELS = ("flash", "cudnn", "cudnn-i64", "per-sequence", "dense")
GPU_ONLY = ("flash", "cudnn", "cudnn-i64")


def row_lengths(mix: str, *, budget: int, seed: int = 0) -> list[int]:
    """Sequence lengths of one packed row: the mix's lengths in drawn order until the next would pass `budget`."""
    lens = []
    for _, n in length_mix.lengths(mix, budget // 8 + 1, seed=seed, max_tokens=min(budget, 2048)):
        if sum(lens) + n > budget:
            break
        lens.append(n)
    return lens


def useful_flops(lens: list[int], *, heads: int, head_dim: int) -> float:
    """Forward FLOPs of causal attention over `lens` (QK^T and PV, half the square each)."""
    return 2 * 2 * sum(n * n / 2 for n in lens) * heads * head_dim


def ragged_cudnn(q, k, v, cu, longest: int, scale: float):
    """cuDNN's ragged causal attention over q/k/v [t, h, hn] with the row's bounds `cu` on the device."""
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, longest, longest, True, 0.0, True, False,
                                                   scale=scale)[0]


def dense(q, k, v, lens: list[int], scale: float):
    """The sequences padded to the longest, causal SDPA over [n, heads, longest, hn], real tokens back."""
    longest, n = max(lens), len(lens)
    keep = torch.arange(longest, device=q.device) < torch.tensor(lens, device=q.device).unsqueeze(1)

    def pad(x):
        out = x.new_zeros(n, longest, *x.shape[1:])
        out[keep] = x
        return out.transpose(1, 2)
    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, scale=scale)
    return out.transpose(1, 2)[keep]


def kernel_fn(name: str, lens: list[int], device, scale: float):
    cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    longest = max(lens)
    return {"flash": lambda q, k, v: VarlenFlash.apply(q, k, v, cu, longest, True, scale, 0.0),
            "cudnn": lambda q, k, v: ragged_cudnn(q, k, v, cu, longest, scale),
            "cudnn-i64": lambda q, k, v: ragged_cudnn(q, k, v, cu.long(), longest, scale),
            "per-sequence": lambda q, k, v: per_sequence(q, k, v, lens, causal=True, scale=scale),
            "dense": lambda q, k, v: dense(q, k, v, lens, scale)}[name]


def measure(name: str, q, k, v, grad, ref: list, *, lens, scale: float, repeats: int) -> dict:
    fn = kernel_fn(name, lens, q.device, scale)
    ins = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    try:
        out = fn(*ins)
    except Exception as e:
        raise RuntimeError(f"forward: {type(e).__name__}: {e}") from e
    try:
        out.backward(grad)
    except Exception as e:
        raise RuntimeError(f"backward: {type(e).__name__}: {e}") from e
    got = [out.detach(), *(x.grad for x in ins)]
    diffs = [(a.float() - b).abs().max().item() for a, b in zip(got, ref)]
    with torch.no_grad():
        fwd = clock.mean_ms(lambda: fn(q, k, v), repeats=repeats, warmup=2, device=q.device)
    both = clock.mean_ms(lambda: fn(*ins).backward(grad), repeats=repeats, warmup=2, device=q.device)
    return dict(max_diff=dict(zip(("out", "dq", "dk", "dv"), diffs)), fwd_ms=fwd, fwd_bwd_ms=both)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mix", default="rl", choices=list(length_mix.MIXES))
    ap.add_argument("--budget", type=int, default=9216, help="tokens in the row at most")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--kernels", default=None,
                    help=f"comma-separated of {','.join(KERNELS)} (default: all on a GPU, the last two on CPU)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="runs/bench/varlen_kernels.json")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernels = args.kernels.split(",") if args.kernels else [k for k in KERNELS if device.type == "cuda" or
                                                            k not in GPU_ONLY]
    if bad := [k for k in kernels if k not in KERNELS]:
        raise SystemExit(f"--kernels: {bad} not allowed; allowed: {','.join(KERNELS)}")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    lens = row_lengths(args.mix, budget=args.budget)
    t, h, hn, scale = sum(lens), args.heads, args.head_dim, args.head_dim ** -0.5
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, grad = (torch.randn(t, h, hn, generator=gen).to(device, dtype) for _ in range(4))
    ref_in = [x.float().requires_grad_() for x in (q, k, v)]
    ref_out = per_sequence(*ref_in, lens, causal=True, scale=scale)
    ref_out.backward(grad.float())
    ref = [ref_out.detach(), *(x.grad for x in ref_in)]
    flops = useful_flops(lens, heads=h, head_dim=hn)
    results = {}
    for name in kernels:
        try:
            r = measure(name, q, k, v, grad, ref, lens=lens, scale=scale, repeats=args.repeats)
            r.update(fwd_tflops=flops / r["fwd_ms"] / 1e9, fwd_bwd_tflops=3.5 * flops / r["fwd_bwd_ms"] / 1e9)
        except Exception as e:   # noqa: BLE001 (recorded in the table and the JSON)
            r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        results[name] = r
    print(f"{args.mix} row: {t} tokens in {len(lens)} sequences (longest {max(lens)}), {h} heads of {hn}, "
          f"{args.dtype}, {device.type}")
    print(f"{'kernel':<13} {'fwd ms':>8} {'TFLOP/s':>8} {'f+b ms':>8} {'TFLOP/s':>8}  max |diff| out / dq / dk / dv")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<13} FAILED {r['error'][:120]}")
            continue
        d = r["max_diff"]
        print(f"{name:<13} {r['fwd_ms']:8.3f} {r['fwd_tflops']:8.1f} {r['fwd_bwd_ms']:8.3f} {r['fwd_bwd_tflops']:8.1f}"
              f"  {d['out']:.2e} / {d['dq']:.2e} / {d['dk']:.2e} / {d['dv']:.2e}")
    write_json(args.out, dict(args=vars(args), lengths=lens, tokens=t, useful_fwd_flops=flops,
                              device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                              results=results))


if __name__ == "__main__":
    main()
