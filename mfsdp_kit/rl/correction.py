"""Rollout correction: importance weights for the train-inference mismatch.

The rollout engine samples from its own kernels, dtype and synced weights, q; the trainer's policy before the
update is pi_old. The PPO ratio pi_theta / pi_old starts at 1 on tokens that came from q, so the update follows
q's law, not pi_old's. Weighting each token by w = pi_old / q (the rollout's own log-probs, which the engine keeps)
makes the gradient's expectation pi_old's again (verl #3915's rollout correction, slime, ms-swift). Large weights
are what make it noisy, hence the modes (`RolloutConfig.rollout_correction`):

    token-truncate     w_t = min(pi_old / q, high)                               (TIS)
    token-mask         w_t = pi_old / q where it lies in [low, high], else the token leaves the loss   (MIS)
    sequence-truncate  W = min(prod_t pi_old / q, high) on every token of the sequence
    sequence-mask      W = prod_t pi_old / q, the whole sequence out of the loss outside [low, high]

With partial rollouts (`rl.partial`) a completion's tokens may come from several policy versions; q is still each
token's own log-prob, recorded when it was sampled, so the weight corrects the staleness of an older token as well
as the engine's numerics, with no change here.

A masked token leaves the loss mask, so it leaves the loss's denominator too (the count megatron divides by), not
only its numerator (slime #657). Diagnostics per iteration: the weights' mean and max, the share truncated or
masked, the k3 estimate of KL(q || pi_old) and the perplexity ratio pi_old / q.
"""
from __future__ import annotations

import math
from typing import Literal

import torch

Mode = Literal["none", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask"]
KEYS = ("is_weight_mean", "is_weight_max", "is_changed_frac", "rollout_kl", "ppl_ratio")
"""The diagnostics an iteration reports (NaN without a correction)."""


def rollout_logprobs_like(rollout: list[list[float]], loss_mask: torch.Tensor) -> torch.Tensor:
    """The rollout's per-completion log-probs laid out as [n, seq] at the loss positions (row-major, as
    `core.rollout_batch` lays completions out), 0 elsewhere."""
    flat = torch.tensor([lp for row in rollout for lp in row], dtype=torch.float32)
    on = loss_mask.bool()
    if flat.numel() != int(on.sum()):
        raise ValueError(f"{flat.numel()} rollout log-probs for {int(on.sum())} loss tokens")
    out = torch.zeros(loss_mask.shape, dtype=torch.float32)
    out[on] = flat
    return out


def weights(trainer: torch.Tensor, rollout: torch.Tensor, loss_mask: torch.Tensor, *, mode: Mode, low: float,
            high: float) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(weights [n, seq], the loss mask with masked tokens removed, diagnostics) for the sampled tokens' log-probs
    under the trainer (`trainer`, pi_old) and the rollout (`rollout`, q), both [n, seq], read where `loss_mask`."""
    w, keep, s = weighted(trainer, rollout, loss_mask, mode=mode, low=low, high=high)
    return w, keep, diagnostics(s)


def weighted(trainer: torch.Tensor, rollout: torch.Tensor, loss_mask: torch.Tensor, *, mode: Mode, low: float,
             high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weights` with the diagnostics still as `sums` on the device (no host sync: the update's loss calls this
    per micro-batch, `rl.on_policy`)."""
    mask = loss_mask.float()
    log_ratio = (trainer.float() - rollout.float()) * mask
    if mode.startswith("token"):
        ratio = torch.exp(log_ratio)
    elif mode.startswith("sequence"):
        ratio = torch.exp(log_ratio.sum(dim=1, keepdim=True)).expand_as(log_ratio)
    else:
        raise ValueError(f"mode={mode!r}: one of {Mode.__args__[1:]} (none applies no weight)")
    if mode.endswith("truncate"):
        w, keep = ratio.clamp(max=high), mask
        changed = (ratio > high).float() * mask
    else:
        inside = ((ratio >= low) & (ratio <= high)).float()
        w, keep = ratio * inside, mask * inside
        changed = (1 - inside) * mask
    return w * keep, keep, sums(log_ratio, ratio, changed, mask)


SUMS = ("tokens", "weight_sum", "weight_max", "changed", "k3_sum", "log_ratio_sum")
"""What `sums` holds, in order: every entry adds over micro-batches and ranks but weight_max, which takes the max."""


def sums(log_ratio: torch.Tensor, ratio: torch.Tensor, changed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The diagnostics' sufficient statistics over the sampled tokens (`SUMS`), a float tensor of 6."""
    on = mask > 0
    r = torch.where(on, ratio, 0.0)
    top = torch.where(on, ratio, -math.inf).max() if on.numel() else ratio.new_tensor(-math.inf)
    return torch.stack([mask.sum(), r.sum(), top, changed.sum(), torch.where(on, ratio - 1 - log_ratio, 0.0).sum(),
                        (log_ratio * mask).sum()]).float()


def diagnostics(s: torch.Tensor) -> dict:
    """From `sums` over the sampled tokens: the weights before truncation or masking (mean, max), the share changed,
    k3's KL(q || pi_old) = E_q[r - 1 - log r] with r = pi_old / q, and ppl(pi_old) / ppl(q) = exp(-mean log r)."""
    n, total, top, changed, k3, log_r = s.tolist()
    if n == 0:
        return dict.fromkeys(KEYS, math.nan)
    return dict(is_weight_mean=total / n, is_weight_max=top, is_changed_frac=changed / n, rollout_kl=k3 / n,
                ppl_ratio=math.exp(-log_r / n))


def needed(mode: Mode, rollout) -> bool:
    """Whether `mode` weights anything; an error naming the field where it would and the backend kept no
    log-probs (`rollout` None)."""
    if mode != "none" and rollout is None:
        raise ValueError(f"rollout_correction={mode!r} needs the rollout's own log-probs, and this backend keeps "
                         "none: use the kit's engine (ContinuousRollout) or HFRollout, or rollout_correction='none'")
    return mode != "none"


def apply(batch, rollout: list[list[float]] | None, *, mode: Mode, low: float, high: float) -> dict:
    """Weight `batch` (a training batch with "old_logprobs") in place: extras["is_weights"], and the loss mask less
    the masked tokens. Returns the diagnostics (NaN for mode "none", which changes nothing)."""
    if not needed(mode, rollout):
        return dict.fromkeys(KEYS, math.nan)
    w, keep, stats = weights(batch.extras["old_logprobs"], rollout_logprobs_like(rollout, batch.loss_mask),
                             batch.loss_mask, mode=mode, low=low, high=high)
    batch.extras["is_weights"] = w
    batch.loss_mask = keep.to(batch.loss_mask.dtype)
    return stats
