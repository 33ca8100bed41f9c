"""A decode step's draw in one Triton kernel: the temperature, the exponential race and the drawn token's log-prob
in one pass over each row's logits (`DecodeConfig.sampler="triton"`).

`sampling.scaled_race` in torch ops makes about ten passes over [rows, vocab] fp32 after the head's GEMM: the cast,
the scaling, the draws, their clamp and log, the difference, the argmax, the log-sum-exp, each a kernel launch. At a
152k vocabulary and 512 rows that is ~4.5 GB of traffic a step; the head's bf16 logits are 156 MB. Here a program per
row streams its logits once, keeping a running max and sum (the log-sum-exp) and the best race key with its index
and scaled logit (ties go to the lowest index, as `torch.argmax`).

The draws are Philox's, keyed by the call's seed: one call (`tl.rand4x`, ten rounds: about 100 integer operations)
gives four uniforms, so each inner step of a row covers four quarters of a block, the j-th quarter's tokens taking the
j-th uniform of the call at counter (step << 32) + row * vocab + (block start) / 4 + (place in the quarter): every
(step, row, token) its own uniform U in [0, 1) (a call per token would cost four times the integer work). E = -log U,
at least 2**-24, as torch's CUDA `exponential_` makes it (Triton's U stays below 1, so the floor is a guard: E = 0
would give its token the key +inf whatever its probability). The same seed and steps draw the same tokens on every
rank; they are not the torch generator's tokens (CPU tests keep the torch path). Top-p needs a sort: `sampling.pick`
keeps it.

With fewer rows than the GPU has SMs, a program per row leaves most of them idle (at 32 rows the step was slower
than the torch ops at a 152k vocabulary; docs/benchmarks.md, "RoPE inside decode attention and the draw kernel,
first timed"). Then each row's
vocabulary is split over `splits` programs, each a run of whole blocks keeping its own running state, and a second
launch merges them per row: the largest key wins (the lower split on a tie, so the lower token, as unsplit), and the
log-sum-exps add. The draws are the same uniforms whatever the split (their counters count from the vocabulary's
start), so the split draws the unsplit kernel's tokens.
"""
from __future__ import annotations

import torch

from ....config import bad_value
from ....models.triton_launch import launch
from .attention import triton

if triton is not None:
    import triton.language as tl
    from triton import next_power_of_2

BLOCK = 2048
"""Logits per inner step of a row's program, in four quarters (fewer when the vocabulary is smaller)."""


def draw(logits: torch.Tensor, *, temperature: float, seed: int, step: int,
         splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [rows] int64, its log-prob [rows] fp32) per row of `logits` [rows, vocab]: `sampling.pick` at top_p 1
    in one kernel. Temperature 0: the argmax, scored at temperature 1. `seed` and `step` (>= 0) choose the draws.
    `splits`: programs per row (default `default_splits`: one unless the rows leave SMs idle); any draws the same
    tokens."""
    rows, vocab = logits.shape
    if rows * vocab >= 2**32 or vocab >= 2**31:   # the Philox counter's low word: row * vocab + a place under vocab
        raise bad_value("logits", tuple(logits.shape), "rows x vocab < 2**32 and vocab < 2**31 for the kernel's "
                        "draws")
    if not 0 <= step < 2**31:
        raise bad_value("step", step, "an integer in [0, 2**31)")
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int) or splits < 1):
        raise bad_value("splits", splits, "a positive int, or None for `default_splits`")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    quarter = max(1, min(BLOCK, next_power_of_2(vocab)) // 4)
    blocks = -(-vocab // (4 * quarter))
    splits = min(blocks, splits or default_splits(rows, logits.device))
    per = -(-blocks // splits) * 4 * quarter   # tokens a split covers: whole blocks, so the draws' counters agree
    splits = -(-vocab // per)
    token = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    state = (logp, token)   # unsplit, the kernel writes the answer; split, each program's state for `_merge`
    if splits > 1:
        state = (torch.empty(4, rows, splits, dtype=torch.float32, device=logits.device),
                 torch.empty(rows, splits, dtype=torch.int64, device=logits.device))
    launch(_draw, (rows, splits), logits, *state, logits.stride(0), 1.0 / temperature if temperature else 1.0,
           seed % 2**62 + 2**62, step, per, rows * splits, VOCAB=vocab, QUARTER=quarter, GREEDY=temperature == 0,
           SPLIT=splits > 1, num_warps=8)   # the Philox key always 64-bit: one compile whatever the seed
    if splits > 1:
        launch(_merge, (rows,), *state, token, logp, splits, rows * splits, SPLITS=next_power_of_2(splits))
    return token, logp


def default_splits(rows: int, device: torch.device) -> int:
    """Programs per row for `draw`: enough that the rows fill the GPU's SMs once (the SM count // rows), at least
    one. On CPU (Triton's interpreter) one."""
    if device.type != "cuda":
        return 1
    return max(1, torch.cuda.get_device_properties(device).multi_processor_count // max(rows, 1))


if triton is not None:
    @triton.jit(do_not_specialize=["inv_t", "seed", "step", "per", "plane"])
    def _draw(LOGITS, OUT, INDEX, stride, inv_t, seed, step, per, plane, VOCAB: tl.constexpr, QUARTER: tl.constexpr,
              GREEDY: tl.constexpr, SPLIT: tl.constexpr):
        """Row r's tokens [s * per, (s + 1) * per): its token and log-prob (OUT = logp, INDEX = token) unsplit; split,
        its running state (OUT [4, rows, splits] fp32: max, sum, best key, its logit; INDEX [rows, splits]: token)."""
        r = tl.program_id(0)
        s = tl.program_id(1)
        row = LOGITS + r.to(tl.int64) * stride
        q = tl.arange(0, QUARTER)
        # the running max of the scaled logits starts finite: a first block of only -inf must not make exp(-inf + inf)
        top = tl.full((), -3.0e38, tl.float32)
        total = tl.full((), 0.0, tl.float32)             # running sum of exp(x - top)
        best = tl.full((), float("-inf"), tl.float32)    # the best race key so far
        best_x = tl.full((), 0.0, tl.float32)            # its scaled logit
        best_i = tl.full((), 0, tl.int64)                # its token
        counter = step.to(tl.int64) * 4294967296 + r.to(tl.int64) * VOCAB
        lo = s * per
        for start in range(lo, tl.minimum(lo + per, VOCAB), 4 * QUARTER):
            if GREEDY:   # unread
                u0, u1, u2, u3 = q.to(tl.float32), q.to(tl.float32), q.to(tl.float32), q.to(tl.float32)
            else:
                u0, u1, u2, u3 = tl.rand4x(seed, counter + start // 4 + q)
            top, total, best, best_x, best_i = _quarter(row, start, u0, inv_t, top, total, best, best_x, best_i,
                                                        VOCAB, QUARTER, GREEDY)
            top, total, best, best_x, best_i = _quarter(row, start + QUARTER, u1, inv_t, top, total, best, best_x,
                                                        best_i, VOCAB, QUARTER, GREEDY)
            top, total, best, best_x, best_i = _quarter(row, start + 2 * QUARTER, u2, inv_t, top, total, best, best_x,
                                                        best_i, VOCAB, QUARTER, GREEDY)
            top, total, best, best_x, best_i = _quarter(row, start + 3 * QUARTER, u3, inv_t, top, total, best, best_x,
                                                        best_i, VOCAB, QUARTER, GREEDY)
        if SPLIT:
            at = r * tl.num_programs(1) + s
            tl.store(OUT + at, top)
            tl.store(OUT + plane + at, total)
            tl.store(OUT + 2 * plane + at, best)
            tl.store(OUT + 3 * plane + at, best_x)
            tl.store(INDEX + at, best_i)
        else:
            tl.store(INDEX + r, best_i)
            tl.store(OUT + r, best_x - top - tl.log(total))

    @triton.jit(do_not_specialize=["splits", "plane"])
    def _merge(STATE, INDEX, TOKEN, LOGP, splits, plane, SPLITS: tl.constexpr):
        """Row r's splits merged: the first largest key (the lowest token on a tie), the log-sum-exps added."""
        r = tl.program_id(0)
        j = tl.arange(0, SPLITS)
        ok = j < splits
        at = r * splits + j
        top = tl.load(STATE + at, mask=ok, other=-3.0e38)
        total = tl.load(STATE + plane + at, mask=ok, other=0.0)
        key = tl.load(STATE + 2 * plane + at, mask=ok, other=float("-inf"))
        x = tl.load(STATE + 3 * plane + at, mask=ok, other=0.0)
        m = tl.max(top, 0)
        i = tl.argmax(key, 0)
        tl.store(TOKEN + r, tl.load(INDEX + r * splits + i))
        tl.store(LOGP + r, tl.sum(tl.where(j == i, x, 0.0), 0) - m - tl.log(tl.sum(total * tl.exp(top - m), 0)))

    @triton.jit
    def _quarter(row, base, u, inv_t, top, total, best, best_x, best_i, VOCAB: tl.constexpr, QUARTER: tl.constexpr,
                 GREEDY: tl.constexpr):
        """The running log-sum-exp and race over tokens base .. base + QUARTER - 1, their uniforms `u`."""
        q = tl.arange(0, QUARTER)
        ok = base + q < VOCAB
        x = tl.load(row + base + q, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        if GREEDY:
            key = x
        else:
            e = tl.maximum(-tl.log(u), 5.960464477539063e-08)   # 2**-24 (module docstring)
            key = tl.where(ok, x - tl.log(e), float("-inf"))
        k = tl.max(key, 0)
        i = tl.argmax(key, 0)   # the quarter's first best
        better = k > best   # strictly: an earlier token keeps a tie
        best_i = tl.where(better, (base + i).to(tl.int64), best_i)
        best_x = tl.where(better, tl.sum(tl.where(q == i, x, 0.0), 0), best_x)
        m = tl.maximum(top, tl.max(x, 0))
        total = total * tl.exp(top - m) + tl.sum(tl.where(ok, tl.exp(x - m), 0.0), 0)
        return m, total, tl.maximum(best, k), best_x, best_i
