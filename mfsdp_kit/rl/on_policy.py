"""Old log-probs from the update's own forward, when the update is one optimizer step.

PPO's ratio pi_theta / pi_old needs pi_old, the policy's log-probs of the sampled tokens before the update. The
naive way runs a no-grad forward over the whole batch first (`core.token_logprobs`), then the update's forward
over the same tokens at the same weights: about a sixth of a GRPO iteration at 1.7 B (docs/benchmarks.md,
"grpo_iteration at the defaults"). When the update is one optimizer step (`ppo_epochs` x `num_minibatches`
== 1), every micro-batch's forward runs before that step, at pi_old's weights, so its own log-probs ARE pi_old's:
the loss takes them detached (ratio exactly 1, gradient grad log pi_theta; verl's actor does the same when it is
on-policy). What the separate pass also fed is made here, per micro-batch, from the same detached log-probs:
  - the train-inference mismatch |logp_rollout - logp_trainer| (`scoring.mismatch`'s mean and max);
  - the rollout correction's weights and masks (`correction.weighted`) and its diagnostics;
  - the reference log-probs when there is no reference model (a copy of pi_old: the KL term is 0).
Their statistics stay on the device until the step is done, then add (max for the maxima) over the data-parallel
ranks, each of which saw only its own micro-batches. With more than one optimizer step, or
`RolloutConfig.recompute_old_logprobs`, the separate pass runs as before (`core.training_batch`).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..train import Batch
from . import correction, scoring


def applies(cfg) -> bool:
    """Whether `cfg` (a `core.RolloutConfig`) takes pi_old from the update's forward: one optimizer step, and the
    separate pass not asked for."""
    return cfg.ppo_epochs * cfg.num_minibatches == 1 and not cfg.recompute_old_logprobs


class OnPolicyLoss:
    """`loss_fn` (a megatron loss_func of `grpo.policy_loss`'s contract) fed "old_logprobs" from its own forward.

    The batch it trains on carries the rollout's log-probs as extras["rollout_logprobs"] [n, seq] (0 off the loss
    positions; absent when the backend keeps none). `stats()` after the update: the mismatch and the correction's
    diagnostics over every rank's tokens."""

    def __init__(self, loss_fn, *, mode: correction.Mode = "none", low: float = 0.5, high: float = 2.0):
        self.loss_fn, self.mode, self.low, self.high = loss_fn, mode, low, high
        self.drift: list[torch.Tensor] = []     # per micro-batch: scoring.drift_sums
        self.sums: list[torch.Tensor] = []      # per micro-batch: correction.sums

    def __call__(self, mb: Batch, token_losses: torch.Tensor):
        old = -token_losses.detach().float()
        extras = dict(mb.extras, old_logprobs=old)
        extras.setdefault("ref_logprobs", old)
        mask = mb.loss_mask
        rollout = mb.extras.get("rollout_logprobs")
        if rollout is not None:
            self.drift.append(scoring.drift_sums(old, rollout, mask))
            if self.mode != "none":
                w, keep, s = correction.weighted(old, rollout, mask, mode=self.mode, low=self.low, high=self.high)
                extras["is_weights"], mask = w, keep.to(mask.dtype)
                self.sums.append(s)
        return self.loss_fn(Batch(mb.tokens, mb.labels, mask, extras), token_losses)

    def stats(self, *, group=None) -> dict:
        """logprob_diff_mean/max (NaN without rollout log-probs) and `correction.KEYS` (NaN for mode "none"), over
        the micro-batches seen here and on every rank of `group` (the data-parallel group; None: this rank)."""
        out = dict(logprob_diff_mean=math.nan, logprob_diff_max=math.nan, **dict.fromkeys(correction.KEYS, math.nan))
        if self.drift:
            out.update(scoring.drift(_reduced(torch.stack(self.drift), maxed=2, group=group)))
        if self.sums:
            out.update(correction.diagnostics(_reduced(torch.stack(self.sums), maxed=2, group=group)))
        return out


def _reduced(rows: torch.Tensor, *, maxed: int, group) -> torch.Tensor:
    """Columns of `rows` [micro-batches, k] summed, column `maxed` maxed, then the same over `group`."""
    out = rows.sum(dim=0)
    out[maxed] = rows[:, maxed].max()
    if group is not None and dist.get_world_size(group) > 1:
        top = out[maxed].clone()
        dist.all_reduce(out, group=group)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        out[maxed] = top
    return out.cpu()
