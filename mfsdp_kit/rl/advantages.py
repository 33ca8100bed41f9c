"""How the critic-free estimators turn an iteration's outcome rewards into advantages; the only place they differ
(`RolloutConfig.advantage_estimator`), the loss and the loop being the same:

    grpo         A_i = (r_i - mean_g) / (std_g + eps)                  within each prompt's group g
    rloo         A_i = r_i - mean_{j in g, j != i} r_j                 leave-one-out baseline (Ahmadian et al. 2024)
    reinforce++  A_i = (r_i - mean_B) / (std_B + eps)                  whitened over the whole batch B, no group
                                                                        baseline (Hu 2025; its KL stays in the loss)

Rewards are [num_prompts * group_size] in group-major order (`core.RolloutBatch`); every rank holds them all.
`core` re-exports `group_advantages` and `ADV_EPS`, as GRPO's names.

With a critic (PPO, `rl.ppo`), advantages are per token instead, [n, seq] in the training batch's layout: GAE
(`gae`) over each completion's tokens, from the outcome reward placed on its last token (`outcome_rewards`) and the
value model's per-token values (`rl.critic`); `whiten` normalises them over the batch's completion tokens.
"""
from __future__ import annotations

from typing import Literal

import torch

from ..config import bad_value

Estimator = Literal["grpo", "rloo", "reinforce++"]
ADV_EPS = 1e-6
"""Keeps a group whose samples all scored alike at A = 0 instead of 0 / 0."""


def group_advantages(rewards: torch.Tensor, *, group_size: int, eps: float = ADV_EPS) -> torch.Tensor:
    """[num_prompts * group_size] rewards -> advantages normalised within each prompt's group:
    A = (r - mean) / (population std + eps)."""
    groups = rewards.view(-1, group_size).float()
    mean, std = groups.mean(dim=1, keepdim=True), groups.std(dim=1, unbiased=False, keepdim=True)
    return ((groups - mean) / (std + eps)).reshape(-1)


def rloo(rewards: torch.Tensor, *, group_size: int) -> torch.Tensor:
    """Each reward less the mean of the others in its group (a group of one: 0)."""
    groups = rewards.view(-1, group_size).float()
    if group_size == 1:
        return torch.zeros_like(groups).reshape(-1)
    others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others).reshape(-1)


def reinforce_pp(rewards: torch.Tensor, *, eps: float = ADV_EPS) -> torch.Tensor:
    """Rewards whitened over the batch: (r - mean) / (population std + eps)."""
    r = rewards.float()
    return (r - r.mean()) / (r.std(unbiased=False) + eps)


def estimate(rewards: torch.Tensor, *, group_size: int, estimator: Estimator) -> torch.Tensor:
    """The advantages of `estimator` for group-major `rewards`."""
    if estimator == "grpo":
        return group_advantages(rewards, group_size=group_size)
    if estimator == "rloo":
        return rloo(rewards, group_size=group_size)
    if estimator == "reinforce++":
        return reinforce_pp(rewards)
    raise bad_value("advantage_estimator", estimator, " | ".join(map(repr, Estimator.__args__)))


# ---- with a critic: per-token advantages -------------------------------------------------------------------------
def outcome_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[n] outcome rewards -> [n, seq] with each reward on its row's last completion token (the last position where
    `loss_mask`), 0 elsewhere; a row without a completion token gets none."""
    on = loss_mask != 0
    seq = on.shape[1]
    last = seq - 1 - on.flip(dims=[1]).float().argmax(dim=1)   # the last True of each row
    out = torch.zeros(on.shape)
    rows = on.any(dim=1).nonzero().flatten()
    out[rows, last[rows]] = rewards.float()[rows]
    return out


def gae(token_rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor, *, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) per completion token: (advantages, returns), [n, seq],
    0 where not `loss_mask`.

    The steps of a row are its loss positions in order (a position outside the mask, such as a tool's output in a
    multi-turn reply, is no step: the chain runs from the step before it to the step after); after the last
    step the episode has ended, V = 0. With r_t the reward of step t and V_t the critic's value there:

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}        (A after the last step = 0)
        R_t     = A_t + V_t                              (the critic's target)

    lam = 1 gives the discounted return minus the value, sum_k gamma^k r_{t+k} - V_t (unbiased, high variance);
    lam = 0 the one-step TD error delta_t. Computed right to left over the positions, all rows at once."""
    mask = loss_mask != 0
    values = values.float() * mask
    adv = torch.zeros(values.shape)
    next_value, next_adv = torch.zeros(values.shape[0]), torch.zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        on = mask[:, t]
        delta = token_rewards[:, t].float() + gamma * next_value - values[:, t]
        a_t = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(on, a_t, 0.0)
        next_value = torch.where(on, values[:, t], next_value)
        next_adv = torch.where(on, a_t, next_adv)
    return adv, (adv + values) * mask


def whiten(x: torch.Tensor, loss_mask: torch.Tensor, *, eps: float = ADV_EPS) -> torch.Tensor:
    """(x - mean) / (population std + eps) over the positions where `loss_mask` (all rows together), 0 elsewhere."""
    mask = loss_mask != 0
    on = x.float()[mask]
    if on.numel() == 0:
        return torch.zeros(x.shape)
    return torch.where(mask, (x.float() - on.mean()) / (on.std(unbiased=False) + eps), 0.0)
