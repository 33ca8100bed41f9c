"""Log-probs at the sampling temperature, and how far the trainer's are from the rollout engine's.

A sampler draws from softmax(logits / T). verl scores the sampled tokens the same way on the trainer side
(logits / T for the old, reference and current policy), so the PPO ratio compares the distribution the
tokens came from, and the rollout's own log-probs can be checked against the trainer's token for token: the
train-inference mismatch (verl's `rollout_probs_diff`), which measures what the rollout engine's kernels,
dtype and weight sync change. Scoring at T 1 instead (`RolloutConfig.score_at_temperature=False`, the kit
before issue 37) gives the ratio of the untempered model, which is not the law the samples followed.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from ..train import Batch
from .correction import rollout_logprobs_like


@contextmanager
def scored_at(chunks, *, temperature: float):
    """Inside the block every forward of `chunks` divides its logits by `temperature` (a forward hook on the
    output layer, whose logits megatron's cross-entropy then reads: vocab-parallel under TP, so no gather).
    Temperature 1 or 0 (greedy sampling, scored at 1) installs nothing."""
    if temperature in (0, 1):
        yield
        return
    hooks = [m.register_forward_hook(lambda _m, _in, out: (out[0] / temperature, *out[1:]))
             for c in chunks for name, m in c.named_modules() if name.split(".")[-1] == "output_layer"]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def mismatch(rollout_logprobs: list[list[float]] | None, batch: Batch) -> dict:
    """Mean and max |logp_rollout - logp_trainer| over the sampled tokens: `batch.extras["old_logprobs"]` at its
    loss positions (row-major, completion after completion, as `core.rollout_batch` lays them out) against the
    backend's log-probs of the same tokens. NaN when the backend does not score."""
    if rollout_logprobs is None:
        return dict(logprob_diff_mean=math.nan, logprob_diff_max=math.nan)
    mask = batch.loss_mask
    return drift(drift_sums(batch.extras["old_logprobs"], rollout_logprobs_like(rollout_logprobs, mask), mask))


def drift_sums(trainer: torch.Tensor, rollout: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[tokens, sum |d|, max |d|] of d = rollout - trainer over the loss positions, on the device (no host sync:
    `rl.on_policy` adds them up per micro-batch, then over ranks)."""
    on = loss_mask.float()
    diff = (rollout.float() - trainer.float()).abs() * on
    return torch.stack([on.sum(), diff.sum(), diff.max()])


def drift(sums: torch.Tensor) -> dict:
    """logprob_diff_mean and logprob_diff_max from `drift_sums` (0 without loss tokens)."""
    tokens, total, top = sums.tolist()
    return dict(logprob_diff_mean=total / tokens if tokens else 0.0, logprob_diff_max=top if tokens else 0.0)
