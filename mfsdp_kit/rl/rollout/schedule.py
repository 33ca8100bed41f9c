"""The rollout engine's scheduling policy, host arithmetic only (no model, no device): which slots a step reads,
which batch a step runs, which prompts one prefill takes: `scheduler.Scheduler`'s arithmetic, kept apart so
tests/rl/test_continuous.py checks it alone."""
from __future__ import annotations


def bucketed(n: int, bucket: int) -> int:
    """`n` rounded up to a multiple of `bucket`."""
    return -(-n // bucket) * bucket


def batch_bucket(n: int, *, rows: int, least: int = 2, per_doubling: int = 2) -> int:
    """The decode batch for `n` live rows: the smallest bucket >= n, at least `least` (`DecodeConfig.min_batch`) and 2
    (a batch of 1 would compile glue of its own), at most `rows`. Buckets are the powers of two, and with
    `per_doubling` 2 (`DecodeConfig.buckets_per_doubling`) also 3/4 of each (..., 48, 64, 96, 128, 192, 256, 384,
    512): a bucket then idles at most a third of its rows, not half."""
    n = max(n, least, 2)
    bucket = 1 << (n - 1).bit_length()
    if per_doubling == 2 and bucket >= 4 and bucket * 3 // 4 >= n:
        bucket = bucket * 3 // 4
    return min(rows, bucket)


def prefill_groups(lengths: list[int], *, budget_tokens: int) -> list[list[int]]:
    """Indices of `lengths` (prompt tokens) in prefill groups: shortest first, each group's padded batch
    (its rows x its longest prompt) at most `budget_tokens`; a prompt longer than the budget is a group alone.
    Sorting keeps the padding small: the naive batch of every free row pads all of them to the longest prompt."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= budget_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
