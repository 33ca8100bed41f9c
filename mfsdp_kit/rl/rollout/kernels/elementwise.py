"""The decode step's elementwise work between the GEMMs in three Triton kernels, on a GPU with
`DecodeConfig.kernels` "auto" (the default) or "triton": RoPE with the cache write, the residual add with the next
RMSNorm, and SiLU(gate) * up (`decoder.Glue` calls them; `decoder.rope_store`, `add_rms` and `gated` are the same
functions in torch ops: the reference, compiled with `kernels="torch"`, eager on CPU).

torch.compile makes the same fusions, but compiling its three functions with symbolic sizes took seconds of a fresh
machine's first rollout (dynamo's own count: docs/benchmarks.md, "grpo_iteration: where a fresh machine's first
iteration and a decode step go"). Triton compiles each kernel
once per head size / hidden size and keeps it in its disk cache; there is no dynamo frame, so nothing can recompile
or fall back to eager. Arithmetic in fp32, one rounding to the cache's dtype at each store.
"""
from __future__ import annotations

import torch

from ....models.triton_launch import launch
from .attention import triton

if triton is not None:
    import triton.language as tl
    from triton import next_power_of_2


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_rows: torch.Tensor, v_rows: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """`decoder.rope_store` in one kernel: q [b, heads, D] and k [b, kv_heads, D] rotated by cos/sin [b, 1, D]
    (HF's rotate_half), k and v [b, kv_heads, D] written to rows `where` [b * kv_heads] of the cache's
    [rows * kv_heads * slots, D] views. q, k, v may be strided views (of the fused q/k/v GEMM's output). Returns
    rotated q [b, heads, 1, D]."""
    b, heads, dim = q.shape
    kv_heads = k.shape[1]
    out = torch.empty(b, heads, 1, dim, dtype=q.dtype, device=q.device)
    launch(_rope_store, (b,), q, k, v, cos, sin, k_rows, v_rows, where, out, q.stride(0), q.stride(1), k.stride(0),
           k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
           HEADS=heads, KV_HEADS=kv_heads, H_PAD=next_power_of_2(heads), KV_PAD=next_power_of_2(kv_heads),
           HALF=dim // 2, HALF_PAD=next_power_of_2(dim // 2), num_warps=4)
    return out


def add_rms(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """`decoder.add_rms` in one kernel: (x + delta, RMSNorm(x + delta) * weight) of [b, hidden] rows, the sum rounded
    to x's dtype before the norm (as the torch ops do)."""
    b, hidden = x.shape
    total, normed = (torch.empty(b, hidden, dtype=x.dtype, device=x.device) for _ in range(2))   # rows contiguous
    launch(_add_rms, (b,), x, delta, weight, total, normed, x.stride(0), delta.stride(0), eps, HIDDEN=hidden,
           BLOCK=next_power_of_2(hidden), num_warps=8 if hidden > 4096 else 4)
    return total, normed


def gated(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of the fused gate/up GEMM's output [b, 2 * ffn] in one kernel: [b, ffn]."""
    b, width = gate_up.shape
    ffn = width // 2
    out = torch.empty(b, ffn, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    launch(_gated, (b, triton.cdiv(ffn, block)), gate_up, out, gate_up.stride(0), FFN=ffn, BLOCK=block, num_warps=4)
    return out


if triton is not None:
    @triton.jit
    def _rotate_pair(base, offs, ok, cos_lo, cos_hi, sin_lo, sin_hi, HALF: tl.constexpr):
        """(lo, hi) halves of rotate_half's RoPE of the heads at `base + offs` (fp32)."""
        lo = tl.load(base + offs, mask=ok, other=0.0).to(tl.float32)
        hi = tl.load(base + offs + HALF, mask=ok, other=0.0).to(tl.float32)
        return lo * cos_lo - hi * sin_lo, hi * cos_hi + lo * sin_hi

    @triton.jit
    def _rope_store(Q, K, V, COS, SIN, KC, VC, WHERE, OUT, sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, scos, ssin,
                    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, KV_PAD: tl.constexpr,
                    HALF: tl.constexpr, HALF_PAD: tl.constexpr):
        r = tl.program_id(0)
        d = tl.arange(0, HALF_PAD)
        d_ok = d < HALF
        cos_lo = tl.load(COS + r * scos + d, mask=d_ok, other=0.0).to(tl.float32)
        cos_hi = tl.load(COS + r * scos + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
        sin_lo = tl.load(SIN + r * ssin + d, mask=d_ok, other=0.0).to(tl.float32)
        sin_hi = tl.load(SIN + r * ssin + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
        h = tl.arange(0, H_PAD)
        ok = (h[:, None] < HEADS) & d_ok[None, :]
        lo, hi = _rotate_pair(Q + r * sq_b, h[:, None] * sq_h + d[None, :], ok, cos_lo[None, :], cos_hi[None, :],
                              sin_lo[None, :], sin_hi[None, :], HALF)
        at = OUT + (r * HEADS + h[:, None]) * (2 * HALF) + d[None, :]
        tl.store(at, lo.to(OUT.dtype.element_ty), mask=ok)
        tl.store(at + HALF, hi.to(OUT.dtype.element_ty), mask=ok)
        g = tl.arange(0, KV_PAD)
        g_ok = g < KV_HEADS
        ok = g_ok[:, None] & d_ok[None, :]
        row = tl.load(WHERE + r * KV_HEADS + g, mask=g_ok, other=0)   # the cache row (slot) of each KV head
        lo, hi = _rotate_pair(K + r * sk_b, g[:, None] * sk_h + d[None, :], ok, cos_lo[None, :], cos_hi[None, :],
                              sin_lo[None, :], sin_hi[None, :], HALF)
        at = row[:, None] * (2 * HALF) + d[None, :]
        tl.store(KC + at, lo.to(KC.dtype.element_ty), mask=ok)
        tl.store(KC + at + HALF, hi.to(KC.dtype.element_ty), mask=ok)
        for part in tl.static_range(2):   # v: copied as it is, half by half
            val = tl.load(V + r * sv_b + g[:, None] * sv_h + part * HALF + d[None, :], mask=ok, other=0.0)
            tl.store(VC + at + part * HALF, val, mask=ok)

    @triton.jit
    def _add_rms(X, DELTA, W, TOTAL, NORMED, sx, sd, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        ok = c < HIDDEN
        total = tl.load(X + r * sx + c, mask=ok, other=0.0).to(tl.float32) + \
            tl.load(DELTA + r * sd + c, mask=ok, other=0.0).to(tl.float32)
        total = total.to(TOTAL.dtype.element_ty)
        tl.store(TOTAL + r * HIDDEN + c, total, mask=ok)
        t = total.to(tl.float32)
        scale = tl.rsqrt(tl.sum(t * t, 0) / HIDDEN + eps)
        w = tl.load(W + c, mask=ok, other=0.0).to(tl.float32)
        tl.store(NORMED + r * HIDDEN + c, (t * scale * w).to(NORMED.dtype.element_ty), mask=ok)

    @triton.jit
    def _gated(GU, OUT, sg, FFN: tl.constexpr, BLOCK: tl.constexpr):
        r, blk = tl.program_id(0), tl.program_id(1)
        c = blk * BLOCK + tl.arange(0, BLOCK)
        ok = c < FFN
        gate = tl.load(GU + r * sg + c, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(GU + r * sg + FFN + c, mask=ok, other=0.0).to(tl.float32)
        tl.store(OUT + r * FFN + c, (gate * tl.sigmoid(gate) * up).to(OUT.dtype.element_ty), mask=ok)
