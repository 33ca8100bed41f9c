"""The rollout engine's scheduling policy, host arithmetic only (no model, no device): which slots a step reads,
which batch a step runs, which prompts one prefill takes: `scheduler.Scheduler`'s arithmetic, kept apart so
tests/rl/test_continuous.py checks it alone."""
from __future__ import annotations


def bucketed(n: int, bucket: int) -> int:
    """`n` rounded up to a multiple of `bucket`."""
    return -(-n // bucket) * bucket


def batch_bucket(n: int, *, rows: int, least: int = 2) -> int:
    """The decode batch for `n` live rows: the next power of two, at least `least` (`DecodeConfig.min_batch`) and 2
    (a batch of 1 would compile glue of its own), at most `rows`."""
    return min(rows, max(least, 2, 1 << max(n - 1, 0).bit_length()))


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
