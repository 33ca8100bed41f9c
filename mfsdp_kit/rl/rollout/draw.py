"""A decode step's draw in one Triton kernel: the temperature, the exponential race and the drawn token's log-prob
in one pass over each row's logits (`DecodeConfig.sampler="triton"`).

`sampling.scaled_race` in torch ops makes about ten passes over [rows, vocab] fp32 after the head's GEMM: the cast,
the scaling, the draws, their clamp and log, the difference, the argmax, the log-sum-exp, each a kernel launch. At a
152k vocabulary and 512 rows that is ~4.5 GB of traffic a step; the head's bf16 logits are 156 MB. Here a program per
row streams its logits once, keeping a running max and sum (the log-sum-exp) and the best race key with its index
and scaled logit (ties go to the lowest index, as `torch.argmax`).

The draws are Philox's (`tl.rand`), keyed by the call's seed, at counter (step << 32) + row * vocab + token: every
(step, row, token) its own uniform U in [0, 1), and E = -log U at least 2**-24, as torch's CUDA `exponential_` makes
it (Triton's U stays below 1, so the floor is a guard: E = 0 would give its token the key +inf whatever its
probability). The same seed and steps draw the same tokens on every rank; they are not the torch generator's tokens
(CPU tests keep the torch path). Top-p needs a sort: `sampling.pick` keeps it.
"""
from __future__ import annotations

import torch

from ...config import bad_value
from ...models.triton_launch import launch
from .attention import triton

if triton is not None:
    import triton.language as tl
    from triton import next_power_of_2

BLOCK = 2048
"""Logits per inner step of a row's program (fewer when the vocabulary is smaller)."""


def draw(logits: torch.Tensor, *, temperature: float, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [rows] int64, its log-prob [rows] fp32) per row of `logits` [rows, vocab]: `sampling.pick` at top_p 1
    in one kernel. Temperature 0: the argmax, scored at temperature 1. `seed` and `step` (>= 0) choose the draws."""
    rows, vocab = logits.shape
    if rows * vocab >= 2**32:   # the Philox counter's low word holds row * vocab + token
        raise bad_value("logits", tuple(logits.shape), "rows x vocab < 2**32 for the kernel's draws")
    if not 0 <= step < 2**31:
        raise bad_value("step", step, "an integer in [0, 2**31)")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    token = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    launch(_draw, (rows,), logits, token, logp, logits.stride(0), 1.0 / temperature if temperature else 1.0,
           seed % 2**62 + 2**62, step, VOCAB=vocab, BLOCK=min(BLOCK, next_power_of_2(vocab)), GREEDY=temperature == 0,
           num_warps=8)   # the Philox key always 64-bit: one compile whatever the seed
    return token, logp


if triton is not None:
    @triton.jit(do_not_specialize=["inv_t", "seed", "step"])
    def _draw(LOGITS, TOKEN, LOGP, stride, inv_t, seed, step, VOCAB: tl.constexpr, BLOCK: tl.constexpr,
              GREEDY: tl.constexpr):
        r = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        # the running max of the scaled logits starts finite: a first block of only -inf must not make exp(-inf + inf)
        top = tl.full((), -3.0e38, tl.float32)
        total = tl.full((), 0.0, tl.float32)             # running sum of exp(x - top)
        best = tl.full((), float("-inf"), tl.float32)    # the best race key so far
        best_x = tl.full((), 0.0, tl.float32)            # its scaled logit
        best_i = tl.full((), 0, tl.int64)                # its token
        counter = step.to(tl.int64) * 4294967296 + r.to(tl.int64) * VOCAB
        for start in range(0, VOCAB, BLOCK):
            c = start + cols
            ok = c < VOCAB
            x = tl.load(LOGITS + r.to(tl.int64) * stride + c, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
            if GREEDY:
                key = x
            else:
                e = tl.maximum(-tl.log(tl.rand(seed, counter + c)), 5.960464477539063e-08)   # 2**-24 (docstring)
                key = tl.where(ok, x - tl.log(e), float("-inf"))
            k = tl.max(key, 0)
            i = tl.argmax(key, 0)   # the block's first best
            better = k > best   # strictly: an earlier block keeps a tie
            best_i = tl.where(better, (start + i).to(tl.int64), best_i)
            best_x = tl.where(better, tl.sum(tl.where(cols == i, x, 0.0), 0), best_x)
            best = tl.maximum(best, k)
            m = tl.maximum(top, tl.max(x, 0))
            total = total * tl.exp(top - m) + tl.sum(tl.where(ok, tl.exp(x - m), 0.0), 0)
            top = m
        tl.store(TOKEN + r, best_i)
        tl.store(LOGP + r, best_x - top - tl.log(total))
