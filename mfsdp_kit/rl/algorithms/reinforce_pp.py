"""REINFORCE++ (Hu 2025): REINFORCE with PPO's clipped ratio and no critic, its advantages normalised over the
whole batch instead of within each prompt's group.

    A_i = (r_i - mean_B) / (std_B + eps)          over every completion of the iteration (`advantages.reinforce_pp`)

Normalised per prompt (GRPO), a group all right or all wrong gets A = 0 and one that barely differs is scaled up by
its tiny std; here rewards are compared across the batch, and one std sets the scale for all. The loss is GRPO's
clipped ratio (`grpo.clipped_loss`) with the KL to a reference in it (`kl_coef`; the paper puts a KL penalty in the
reward instead).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...fieldtypes import check_fields
from ..advantages import Estimator
from .grpo import GRPOConfig, clipped_loss, outcome_advantages
from .registration import Algorithm, register


@dataclass(kw_only=True)
class ReinforcePPConfig(GRPOConfig):
    """GRPO's knobs (`grpo.GRPOConfig`: the clip, `min_advantage`, the loss level) with batch-normalised advantages
    (the groups are not read: `samples_per_prompt` is only how many completions each prompt gets)."""

    advantage_estimator: Estimator = "reinforce++"
    """Whitened over the batch (`advantages.reinforce_pp`); the other estimators are GRPOConfig's."""

    def __post_init__(self):
        super().__post_init__()
        check_fields(self, advantage_estimator=((lambda v: v == "reinforce++"),
                                                "'reinforce++' (GRPOConfig takes the others)"))


REINFORCE_PP = register(Algorithm(name="reinforce++", config=ReinforcePPConfig, loss=clipped_loss,
                                  advantages=outcome_advantages))
