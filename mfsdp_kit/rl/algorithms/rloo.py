"""RLOO (Ahmadian et al. 2024, "Back to Basics"): REINFORCE with a leave-one-out baseline in each prompt's group.

    A_i = r_i - mean_{j in g, j != i} r_j = (n / (n - 1)) (r_i - mean_g)          (`advantages.rloo`)

Each sample's baseline is the mean of the other n - 1 samples of its prompt, so it is independent of the sample
itself and the estimate unbiased; unlike GRPO nothing divides by the group's std, so a group that barely differs
moves the policy barely. The loss is GRPO's clipped ratio (`grpo.clipped_loss`; with one optimizer step per
iteration the ratio is 1 and it is REINFORCE's), the KL to a reference stays in it (`kl_coef`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...fieldtypes import check_fields
from ..advantages import Estimator
from .grpo import GRPOConfig, clipped_loss, outcome_advantages
from .registration import Algorithm, register


@dataclass(kw_only=True)
class RLOOConfig(GRPOConfig):
    """GRPO's knobs (`grpo.GRPOConfig`: the clip, `min_advantage`, the loss level) with the leave-one-out baseline."""

    advantage_estimator: Estimator = "rloo"
    """Leave-one-out (`advantages.rloo`); the other estimators are GRPOConfig's."""

    def __post_init__(self):
        super().__post_init__()
        check_fields(self, advantage_estimator=((lambda v: v == "rloo"), "'rloo' (GRPOConfig takes the others)"))


RLOO = register(Algorithm(name="rloo", config=RLOOConfig, loss=clipped_loss, advantages=outcome_advantages))
