"""How the critic-free estimators turn an iteration's outcome rewards into advantages; the only place they differ
(`RolloutConfig.advantage_estimator`), the loss and the loop being the same:

    grpo         A_i = (r_i - mean_g) / (std_g + eps)                  within each prompt's group g
    rloo         A_i = r_i - mean_{j in g, j != i} r_j                 leave-one-out baseline (Ahmadian et al. 2024)
    reinforce++  A_i = (r_i - mean_B) / (std_B + eps)                  whitened over the whole batch B, no group
                                                                        baseline (Hu 2025; its KL stays in the loss)

Rewards are [num_prompts * group_size] in group-major order (`core.RolloutBatch`); every rank holds them all.
`core` re-exports `group_advantages` and `ADV_EPS`, as GRPO's names.
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
