"""GRPO: advantages normalised within each prompt's group, the clipped-ratio loss with a k3 KL to a reference.

    A_i  = (r_i - mean(r)) / (std(r) + eps) over the group of prompt i, eps = 1e-6 so a group whose samples all
           scored alike gets A = 0 instead of a division by zero (`advantages.group_advantages`)
    l_it = -min(rho * A_i, clip(rho, 1 - eps, 1 + eps) * A_i) + kl_coef * k3_it,  rho = exp(log p_theta - log p_old)
    k3_it = exp(d) - d - 1,  d = log p_ref - log p_theta     (>= 0, unbiased for KL(pi || ref))

averaged over all completion tokens of the minibatch (`loss_level="token"`, as the kit's GRPO always did through
megatron's per-token loss), or per sequence first (`"sequence"`, the paper's (1/G) sum_i (1/|o_i|) sum_t l_it);
`core.aggregate` writes both out. `policy_loss` is every algorithm's policy term here (DAPO, RLOO, REINFORCE++, PPO).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from ...train import Batch
from .. import core
from .registration import Algorithm, Estimate, critic_free, register


@dataclass(kw_only=True)
class GRPOConfig(core.RolloutConfig):
    """Knobs of one GRPO run: the shared ones (`core.RolloutConfig`) and the clipped loss's."""

    clip_eps: float = 0.2
    """Ratio clip: the loss stops pushing once ratio leaves [1 - clip_eps, 1 + clip_eps]."""
    min_advantage: float | None = None
    """Advantages below this are raised to it (None = plain GRPO). 0.0 keeps only the better-than-
    group-mean samples: they are pushed up, the worse ones are left alone instead of pushed down."""
    loss_level: core.LossLevel = "token"
    """"token": mean over all completion tokens of a minibatch; "sequence": mean of per-sequence
    means (the GRPO paper). See `rl.core.aggregate`."""


def policy_loss(mb: Batch, token_losses: torch.Tensor, *, eps_low: float, eps_high: float, kl_coef: float,
                level: core.LossLevel = "token"):
    """megatron loss_func of the clipped-ratio objective (module docstring) with the clip range
    [1 - eps_low, 1 + eps_high]; token_losses = -log p_theta(sampled token). Logs kl, clip_frac
    and the sampled-token entropy estimate as per-token means."""
    mask = mb.loss_mask.float()
    logp = -token_losses.float()
    ratio = torch.exp(logp - mb.extras["old_logprobs"])
    adv = mb.extras["advantages"] if mb.extras["advantages"].dim() == 2 else mb.extras["advantages"].unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if "is_weights" in mb.extras:   # rollout correction (rl.correction): pi_old / q, truncated or masked
        per_token = per_token * mb.extras["is_weights"]
    delta = mb.extras["ref_logprobs"] - logp
    kl = torch.exp(delta) - delta - 1  # k3 estimator: >= 0, unbiased for KL(pi || ref)
    if kl_coef:
        per_token = per_token + kl_coef * kl
    loss_sum, count = core.aggregate(per_token, mask, level=level)
    tokens = mask.sum()
    clip_frac = ((ratio - clipped).abs() > 0).float()
    logged = {"lm loss": torch.stack([loss_sum.detach(), count]),
              "kl": torch.stack([(kl.detach() * mask).sum(), tokens]),
              "clip_frac": torch.stack([(clip_frac * mask).sum(), tokens]),
              "entropy": torch.stack([(-logp.detach() * mask).sum(), tokens])}  # sampled-token estimate
    return loss_sum, count.to(torch.int), logged


def grpo_loss(mb: Batch, token_losses: torch.Tensor, *, clip_eps: float, kl_coef: float,
              level: core.LossLevel = "token"):
    """megatron loss_func for GRPO: `policy_loss` with the symmetric clip [1 - clip_eps, 1 + clip_eps]."""
    return policy_loss(mb, token_losses, eps_low=clip_eps, eps_high=clip_eps, kl_coef=kl_coef, level=level)


def clipped_loss(cfg):
    """`grpo_loss` with `cfg`'s clip_eps, kl_coef and loss_level (GRPO's, RLOO's, REINFORCE++'s and PPO's loss)."""
    return partial(grpo_loss, clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef, level=cfg.loss_level)


def outcome_advantages(kept: core.RolloutBatch, cfg: GRPOConfig, **context) -> Estimate:
    """The critic-free estimator `cfg` names (`registration.critic_free`: GRPO's group baseline, RLOO's leave-one-out,
    REINFORCE++'s batch whitening), raised to `cfg.min_advantage` where one is set."""
    estimate = critic_free(kept, cfg, **context)
    if cfg.min_advantage is not None:
        estimate.advantages = estimate.advantages.clamp(min=cfg.min_advantage)
    return estimate


GRPO = register(Algorithm(name="grpo", config=GRPOConfig, loss=clipped_loss, advantages=outcome_advantages))
