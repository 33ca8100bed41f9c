"""The decode step's GEMMs at small batch in one Triton kernel: y = x @ w^T for x [M, K] of a few rows (M <= 128) and
a layer's weight w [N, K].

At small batch a decode step reads every weight once and does little else with it, so its GEMMs should run at the
memory's speed. cuBLAS's kernels at 32 rows read tiny `l`'s weights at 56 % of an H200's bandwidth (q/k/v 37 %, o
29 %, gate/up 73 %, down 62 %; docs/benchmarks.md): a small weight (8-13 MB) is read in one short wave with a ramp
of its own, and a long K (down's 8,192) is split with a separate reduction kernel. Here ("swap AB", as decode GEMMs
for few rows are usually written): a program takes `block_n` rows of the weight, the tile's rows, and the batch is
the tile's columns, so K is streamed once per weight row whatever M is; `splits` > 1 splits K over programs and
writes fp32 partial sums [splits, M, N] that the next kernel adds as it reads them (`rl.rollout.elementwise`), with
no reduction kernel of its own.

`bench/decode_gemm.py` measures it against cuBLAS per weight shape and batch, over every config of `CONFIGS`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...models.triton_launch import launch
from .attention import triton

if triton is not None:
    import triton.language as tl


@dataclass(frozen=True)
class GemmConfig:
    """One launch shape of the kernel."""

    block_n: int = 64
    """Weight rows per program (the tile's rows)."""
    block_k: int = 128
    """K elements per inner step."""
    splits: int = 1
    """Programs K is split over (fp32 partial sums out when > 1); K must be a multiple of splits x block_k."""
    stages: int = 4
    """Triton's software pipeline depth (loads in flight per program)."""
    warps: int = 4

    def fits(self, *, k: int, rows: int) -> bool:
        """Whether it runs on a K of `k` for `rows` rows: K splits into whole steps, and the pipeline's tiles fit
        in shared memory (200 KiB of an sm90's 227)."""
        block_m = max(16, 1 << max(rows - 1, 0).bit_length())
        tiles = self.stages * (self.block_n + block_m) * self.block_k * 2
        return k % (self.splits * self.block_k) == 0 and tiles <= 200 * 1024


CONFIGS = tuple(GemmConfig(block_n=n, block_k=k, splits=s, stages=st)
                for n in (32, 64, 128) for k in (64, 128, 256) for s in (1, 2, 4, 8) for st in (3, 5))
"""The configs `bench/decode_gemm.py` tries."""


MAX_ROWS = 128
"""Rows up to which the decode step's down projection runs here, SiLU * up included (`down_config`):
bench/decode_gemm.py on 1 H100 timed it 1.07-1.15x cuBLAS at 16-64 rows for tiny `l` and the 7 B shape, level at
128, and it also saves the SiLU * up kernel."""


def down_config(*, n: int, k: int, rows: int, sms: int) -> GemmConfig | None:
    """The config for the down projection of `rows` rows (w [n, k]) on a device of `sms` multiprocessors, or None
    where it should stay cuBLAS's (past `MAX_ROWS`, or no config fits K): 64 weight rows a program, 128 of K a step,
    K split over as many programs as keep one wave (bench/decode_gemm.py's best at 16-64 rows: 4 splits for tiny
    `l`'s 2,048 x 8,192, 2 for the 7 B shape's 3,584 x 18,944), the deepest pipeline that fits."""
    if rows > MAX_ROWS:
        return None
    for splits in (8, 4, 2, 1):
        if -(-n // 64) * splits > sms and splits > 1:
            continue
        for stages in (5, 4, 3):
            config = GemmConfig(block_n=64, block_k=128, splits=splits, stages=stages)
            if config.fits(k=k, rows=rows):
                return config
    return None


def skinny(x: torch.Tensor, w: torch.Tensor, config: GemmConfig, *, gated: bool = False) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T: [M, N] in x's dtype with one split, else fp32 partial sums [splits, M, N] whose sum
    over the first dimension is the product. x's rows and w's rows must be contiguous along K. `gated`: x is a fused
    gate/up output [M, 2K] and the product is of SiLU(gate) * up (`elementwise.gated`'s arithmetic, rounded to x's
    dtype as it rounds), so the MLP's down projection needs no kernel of its own for it."""
    m, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    n = w.shape[0]
    if not config.fits(k=k, rows=m) or x.stride(1) != 1 or w.stride(1) != 1 or w.shape[1] != k:
        raise ValueError(f"skinny GEMM: K={k} is not a multiple of splits x block_k ({config.splits} x "
                         f"{config.block_k}), its tiles for {m} rows pass shared memory, or a row is strided")
    dtype = x.dtype if config.splits == 1 else torch.float32
    out = torch.empty(config.splits, m, n, dtype=dtype, device=x.device)
    launch(_skinny, (triton.cdiv(n, config.block_n), config.splits), x, w, out, m, n, k, k // config.splits,
           x.stride(0), w.stride(0), GATED=gated, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=config.block_n,
           BLOCK_K=config.block_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
           num_warps=config.warps, num_stages=config.stages)
    return out[0] if config.splits == 1 else out


if triton is not None:
    @triton.jit
    def _skinny(X, W, OUT, M, N, K, k_split, sxm, swn, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        pid_n, split = tl.program_id(0), tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        kk = tl.arange(0, BLOCK_K)
        n_ok, m_ok = n < N, m < M
        start = split * k_split
        w_at = W + n[:, None].to(tl.int64) * swn + start + kk[None, :]   # [BLOCK_N, BLOCK_K]
        x_at = X + m[None, :] * sxm + start + kk[:, None]                 # [BLOCK_K, BLOCK_M]: x^T
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for _ in range(0, k_split, BLOCK_K):
            w = tl.load(w_at, mask=n_ok[:, None], other=0.0)
            if GATED:   # SiLU(gate) * up, in fp32, rounded to the weight's dtype as `elementwise.gated` stores it
                gate = tl.load(x_at, mask=m_ok[None, :], other=0.0).to(tl.float32)
                up = tl.load(x_at + K, mask=m_ok[None, :], other=0.0).to(tl.float32)
                x = (gate * tl.sigmoid(gate) * up).to(W.dtype.element_ty)
            else:
                x = tl.load(x_at, mask=m_ok[None, :], other=0.0)
            acc += tl.dot(w, x, input_precision=PRECISION)
            w_at += BLOCK_K
            x_at += BLOCK_K
        out = OUT + split.to(tl.int64) * M * N + m[None, :] * N + n[:, None]
        tl.store(out, acc.to(OUT.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])
