"""Decode attention on a GPU: one query per row against that row's own cached keys, in two Triton kernels
(`DecodeConfig.kernels`, "auto" by default: these on a GPU that runs them, `models.support.triton_available`; "torch":
`decoder.decode`'s SDPA).

SDPA over the slot bucket (`decoder.decode` with `kernels="torch"`) reads every row up to the bucket and, in cuDNN's
kernel for grouped heads, reads each K/V head once per query head of its group; and cuDNN builds a plan for every new
(batch, slots) shape, so a cache's 54 graphs spend seconds on plans at capture (docs/benchmarks.md, "grpo_iteration:
where a fresh machine's first iteration and a decode step go"). Here, flash-decoding's split over the keys:
  - `_attention_partial`: a program per (row, KV head, split of the slots) reads its keys once for the whole query
    group (the group's queries are the rows of one tile), only up to the row's position (and from its window's
    start), with an online softmax; it writes the split's unnormalised output, max and sum;
  - `_attention_combine`: a program per (row, query head) merges the splits (with one split, the first kernel
    writes the output itself).
With `new` (`DecodeConfig.fuse_rope`), the first kernel also does `elementwise.rope_store`'s work: it takes the
step's q, k, v as the q/k/v GEMM left them, rotates q (each program its own group's) and k, and the program whose
share holds the row's position writes k and v into the cache there and attends to them from registers (no other
program of the step reads that slot): one launch a layer fewer, and no rotated q written and read back.
Splits are as many as fill the device twice over at small batch, one at large; each row's own keys are shared out
over them at run time. Triton compiles a kernel per head size and group and a few specialisations of its integer
arguments (not per batch or slot bucket), and its disk cache keeps them: no plan per shape.
"""
from __future__ import annotations

import functools

import torch

from ....models.triton_launch import launch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only torch: `decoder.decode` attends with SDPA
    triton = None

BLOCK_N = 64
"""Keys per inner step (the tile's columns)."""


@functools.lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (CPU tensors run in Triton's interpreter, TRITON_INTERPRET=1: say 4)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def splits_for(*, programs: int, slots: int, sms: int) -> int:
    """Splits of `slots` keys so that `programs` (rows x KV heads) x splits fill `sms` twice, each split at least
    `BLOCK_N` keys."""
    return max(1, min(-(-2 * sms // programs), -(-slots // BLOCK_N)))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, *,
                     slots: int, window: int | None, scale: float, new: tuple | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v per row r and query head, over the keys of slots max(0, pos[r] - window + 1) ..
    pos[r] (every slot <= pos[r] without a window; every pos[r] < `slots`): `q` [b, heads, D] against the first b
    rows of the cache's [rows, kv_heads, all slots, D] K and V (query head h reads KV head h // (heads / kv_heads)).
    Each row's own keys are split evenly over the splits at run time, so `slots` (the cache's, in the engine) only
    bounds how many splits there are. Returns [b, heads, D] in q's dtype.

    `new` = (k, v, cos, sin): the step's own key and value [b, kv_heads, D] and each row's RoPE rows [b, D] (HF's
    rotate_half layout); then `q` is not yet rotated, and q and k are rotated here and k, v written into the cache at
    slot pos[r] before they are attended to (`decoder.rope_store` and this in one launch). q, k and v may be strided
    views (of the q/k/v GEMM's output)."""
    b, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    splits = splits_for(programs=b * kv_heads, slots=slots, sms=_sms(q.device))
    if new is None:
        q = q.contiguous()
        k_new = v_new = cos = sin = q   # not read
    else:
        k_new, v_new, cos, sin = new
    out = torch.empty(b, heads, dim, dtype=q.dtype, device=q.device)
    whole = splits == 1   # one split: the partial kernel normalises and writes the output itself
    part = out if whole else torch.empty(b, heads, splits, dim, dtype=torch.float32, device=q.device)
    stats = torch.empty(2, b, heads, splits, dtype=torch.float32, device=q.device)   # max, sum
    launch(
        _attention_partial, (b, kv_heads, splits), q, k_cache, v_cache, pos, part, stats, k_new, v_new, cos, sin,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stats.stride(0),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), cos.stride(0), sin.stride(0), scale,
        window or 0, GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), DIM=dim,
        D_PAD=triton.next_power_of_2(dim), BLOCK_N=BLOCK_N, WINDOWED=window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WHOLE=whole, ROPE=new is not None, num_warps=4,
        num_stages=2)
    if not whole:
        launch(_attention_combine, (b, heads), part, stats, out, splits, stats.stride(0), DIM=dim,
               D_PAD=triton.next_power_of_2(dim), S_PAD=max(2, triton.next_power_of_2(splits)), num_warps=4)
    return out


if triton is not None:
    @triton.jit
    def _rotated(x_at, partner_at, ok, first_half, cos, sin):
        """rotate_half's RoPE (fp32) of the elements at `x_at`: x * cos + rotate_half(x) * sin, where rotate_half's
        element i is -x[i + D/2] in the first half (`first_half`) and x[i - D/2] in the second (at `partner_at`)."""
        x = tl.load(x_at, mask=ok, other=0.0).to(tl.float32)
        partner = tl.load(partner_at, mask=ok, other=0.0).to(tl.float32)
        return x * cos + tl.where(first_half, -partner, partner) * sin

    @triton.jit
    def _online(s, n_ok, v, m_i, l_i, acc, PRECISION: tl.constexpr):
        """The running max, sum and output of a query group after the scores `s` [G, N] (keys where `n_ok`) and
        their values `v` [N, D]."""
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _attend_new(K, V, at, K_NEW, V_NEW, q, cos, sin, d, d_ok, partner, first_half, scale, m_i, l_i, acc):
        """The step's own key and value of one row and KV head (at K_NEW and V_NEW): k rotated, both rounded to the
        cache's dtype and written at cache offset `at` (the row's slot pos), and the query group `q` (rotated)
        attending to them from registers. Returns the running max, sum and output after them."""
        k = _rotated(K_NEW + d, K_NEW + partner, d_ok, first_half, cos, sin).to(K.dtype.element_ty)
        v = tl.load(V_NEW + d, mask=d_ok, other=0.0).to(V.dtype.element_ty)
        tl.store(K + at + d, k, mask=d_ok)
        tl.store(V + at + d, v, mask=d_ok)
        s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1) * scale
        m_new = tl.maximum(m_i, s)   # finite: s is (m_i is -inf where the share had no cached key)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        return m_new, l_i * alpha + p, acc * alpha[:, None] + p[:, None] * v.to(tl.float32)[None, :]

    @triton.jit
    def _attention_partial(Q, K, V, POS, PART, STATS, K_NEW, V_NEW, COS, SIN, stride_qb, stride_qh, stride_kr,
                           stride_kh, stride_ks, stride_stat, stride_nkb, stride_nkh, stride_nvb, stride_nvh,
                           stride_cos, stride_sin, scale, window, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                           DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr,
                           PRECISION: tl.constexpr, WHOLE: tl.constexpr, ROPE: tl.constexpr):
        """Program (row, KV head, split): its group's queries Q [b, heads, D] over its share of the row's keys in the
        cache K, V [rows, kv_heads, slots, D] (strides in elements); writes the share's output (normalised into PART
        [b, heads, D] when WHOLE, else unnormalised into PART [b, heads, splits, D] with max and sum in STATS
        [2, b, heads, splits]). ROPE: Q and the step's K_NEW, V_NEW [b, kv_heads, D] as the GEMM left them, COS and
        SIN [b, D]; see `decode_attention`'s `new`."""
        row, kv, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n_kv, n_splits = tl.num_programs(1), tl.num_programs(2)
        row64 = row.to(tl.int64)
        pos = tl.load(POS + row).to(tl.int32)
        first = pos * 0   # the row's keys: first .. pos
        if WINDOWED:
            first = tl.maximum(pos - window + 1, 0)
        chunk = tl.cdiv(tl.cdiv(pos + 1 - first, n_splits), BLOCK_N) * BLOCK_N   # its share, whole tiles
        lo = first + split * chunk
        hi = tl.minimum(lo + chunk, pos + 1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        head = kv * GROUP + g
        g_ok, d_ok = g < GROUP, d < DIM
        base = row64 * stride_kr + kv.to(tl.int64) * stride_kh   # a cache may pass 2**31 elements
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        q_at = Q + row64 * stride_qb + head[:, None] * stride_qh
        if ROPE:   # q rotated and rounded as rope_store stores it; slot pos is left to `_attend_new`
            first_half = d < DIM // 2
            partner = tl.where(first_half, d + DIM // 2, d - DIM // 2)   # rotate_half pairs element i with i +- D/2
            cos = tl.load(COS + row64 * stride_cos + d, mask=d_ok, other=0.0).to(tl.float32)
            sin = tl.load(SIN + row64 * stride_sin + d, mask=d_ok, other=0.0).to(tl.float32)
            q = _rotated(q_at + d[None, :], q_at + partner[None, :], g_ok[:, None] & d_ok[None, :],
                         first_half[None, :], cos[None, :], sin[None, :]).to(Q.dtype.element_ty)
            top = tl.minimum(hi, pos)
        else:
            q = tl.load(q_at + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
            top = hi
        for start in range(lo, top, BLOCK_N):   # the cached keys of the share
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < top
            offs = base + n[:, None] * stride_ks + d[None, :]
            k = tl.load(K + offs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            v = tl.load(V + offs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            m_i, l_i, acc = _online(s, n_ok, v, m_i, l_i, acc, PRECISION)
        if ROPE:
            if (lo <= pos) & (pos < hi):   # the one share that holds slot pos
                m_i, l_i, acc = _attend_new(K, V, base + pos.to(tl.int64) * stride_ks,
                                            K_NEW + row64 * stride_nkb + kv * stride_nkh,
                                            V_NEW + row64 * stride_nvb + kv * stride_nvh, q, cos, sin, d, d_ok,
                                            partner, first_half, scale, m_i, l_i, acc)
        at = (row * n_kv * GROUP + head) * n_splits + split   # [b, heads, splits] index of each head of the group
        if WHOLE:   # PART is the output [b, heads, D]
            tl.store(PART + at[:, None] * DIM + d[None, :], (acc / l_i[:, None]).to(PART.dtype.element_ty),
                     mask=g_ok[:, None] & d_ok[None, :])
        else:
            tl.store(PART + at[:, None] * DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
            tl.store(STATS + at, m_i, mask=g_ok)
            tl.store(STATS + stride_stat + at, l_i, mask=g_ok)

    @triton.jit
    def _attention_combine(PART, STATS, OUT, splits, stride_stat, DIM: tl.constexpr, D_PAD: tl.constexpr,
                           S_PAD: tl.constexpr):
        row, head = tl.program_id(0), tl.program_id(1)
        n_heads = tl.num_programs(1)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D_PAD)
        s_ok, d_ok = s < splits, d < DIM
        at = (row * n_heads + head) * splits + s
        m = tl.load(STATS + at, mask=s_ok, other=float("-inf"))
        l = tl.load(STATS + stride_stat + at, mask=s_ok, other=0.0)
        w = tl.exp(m - tl.max(m, 0))   # an empty split (max -inf) weighs 0
        o = tl.load(PART + at[:, None] * DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        out = tl.sum(o * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(OUT + (row * n_heads + head) * DIM + d, out.to(OUT.dtype.element_ty), mask=d_ok)
