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
    trainer = batch.extras["old_logprobs"][batch.loss_mask.bool()]
    rollout = torch.tensor([lp for row in rollout_logprobs for lp in row], dtype=trainer.dtype)
    if rollout.shape != trainer.shape:
        raise ValueError(f"{rollout.numel()} rollout log-probs for {trainer.numel()} loss tokens")
    diff = (rollout - trainer).abs()
    return dict(logprob_diff_mean=diff.mean().item() if diff.numel() else 0.0,
                logprob_diff_max=diff.max().item() if diff.numel() else 0.0)
