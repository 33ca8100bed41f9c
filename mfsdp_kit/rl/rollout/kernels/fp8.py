"""FP8 GEMMs of the rollout engine's projections (`DecodeConfig.weights="fp8"`): row-wise e4m3 quantization and the
scaled GEMM on it.

A decode step at 64 rows is a read of every weight once: its time is the weights' bytes over the memory bandwidth
(`bench/rollout.py`'s floor). The naive FP8 path (a per-tensor scale, `torch._scaled_mm` with two scalars) loses a
whole tensor's range to its largest channel; here each weight's output channel has its own fp32 scale (amax / 448,
e4m3's largest finite value) and each activation row (token) its own, made on the fly:

    y[m, n] = (sum_k qx[m, k] * qw[n, k]) * sx[m] * sw[n]        qx = x / sx, qw = w / sw, both e4m3

`torch._scaled_mm(qx, qw.T, scale_a=sx [M, 1], scale_b=sw [1, N], out_dtype=bf16)` runs it in one cuBLASLt/CUTLASS
kernel on sm89+ (its row-wise scaling). K and N must be multiples of 16 (`fits`).

    quantize_rows        the torch twin: what runs off a GPU, the reference of `quantize_rows_kernel`, and the
                         weights' quantization (once per weight change: `rollout.fp8.Fp8Weights`)
    quantize_rows_kernel one Triton program a row: its amax, then its e4m3 values (a decode step's activations: one
                         launch a GEMM, where the torch twin is ~6 kernels)
    dequantized_linear   the reference of the FP8 GEMM in fp32: (qx * sx) @ (qw * sw).T
"""
from __future__ import annotations

import torch

from ....models.triton_launch import launch
from .attention import triton

if triton is not None:
    import triton.language as tl
    from triton import next_power_of_2

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
"""e4m3fn's largest finite value (`torch.finfo(torch.float8_e4m3fn).max`): a row's amax maps to it."""
BLOCK_MAX = 4096
"""Elements of a row a program reads at a time (hidden and FFN widths above it take several passes)."""


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [M, K] as (q [M, K] e4m3, scale [M, 1] fp32) with x ~= q * scale: each row's amax / 448, so its largest
    element lands on e4m3's largest value. An all-zero row gets scale 1 (its q is zeros), never a division by 0."""
    amax = x.abs().amax(-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def dequantized_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """The FP8 GEMM's reference in fp32: `x` [..., K] quantized per row (`quantize_rows`), times the weight
    dequantized (`q` [N, K] e4m3, `scale` [1, N] fp32), plus `bias`; in `x`'s dtype."""
    qx, sx = quantize_rows(x.reshape(-1, x.shape[-1]))
    out = (qx.float() * sx) @ (q.float() * scale.reshape(-1, 1)).t()
    out = out if bias is None else out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], -1)


def scaled_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                  kernel: bool) -> torch.Tensor:
    """`dequantized_linear` on the GPU: `x` [..., K] bf16 quantized per row (`quantize_rows_kernel` with `kernel`,
    else the torch twin), one `torch._scaled_mm` with row-wise scales, `bias` added after (row-wise scaling takes no
    bias in every torch release). `q` [N, K] e4m3 contiguous (passed as its column-major transpose), `scale` [1, N]."""
    rows = x.reshape(-1, x.shape[-1])
    qx, sx = quantize_rows_kernel(rows) if kernel else quantize_rows(rows)
    out = torch._scaled_mm(qx, q.t(), scale_a=sx, scale_b=scale, out_dtype=x.dtype)
    out = out if bias is None else out + bias
    return out.reshape(*x.shape[:-1], -1)


def fits(weight: torch.Tensor) -> bool:
    """Whether `torch._scaled_mm` takes this [N, K] weight: both sizes multiples of 16."""
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def quantize_rows_kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` in one Triton launch, a program per row of `x` [M, K] (its last dimension contiguous)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=E4M3, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    launch(_quantize_rows, (m,), x, q, scale, x.stride(0), K=k, BLOCK=min(next_power_of_2(k), BLOCK_MAX),
           MAX=E4M3_MAX, num_warps=8 if k > 2048 else 4)
    return q, scale


if triton is not None:
    @triton.jit
    def _quantize_rows(x, q, scale, stride, K: tl.constexpr, BLOCK: tl.constexpr, MAX: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):   # pass 1: the row's amax
            v = tl.load(x + row * stride + start + offs, mask=start + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        top = tl.max(amax, 0)
        s = tl.where(top > 0, top / MAX, 1.0)
        tl.store(scale + row, s)
        for start in range(0, K, BLOCK):   # pass 2: its values (the row is in L2 by now)
            v = tl.load(x + row * stride + start + offs, mask=start + offs < K, other=0.0).to(tl.float32)
            v = tl.minimum(tl.maximum(v / s, -MAX), MAX)
            tl.store(q + row * K + start + offs, v.to(tl.float8e4nv), mask=start + offs < K)
