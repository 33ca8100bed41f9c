"""DAPO (Yu et al. 2025): GRPO with three changes, each a small function here.

1. Dynamic sampling, its filter: groups whose rewards are all equal (A = 0: no gradient) are dropped and more prompts
   sampled until `prompts_per_iteration` groups are kept or `max_sampling_rounds` rounds ran (`dynamic_sample`),
   trimmed to what the minibatches split (`usable_groups`); none left: no update that iteration.
2. Token-level loss, L = sum_i sum_t l_it / sum_i |o_i| (`core.aggregate`, "token"): every token weighs the same.
3. Clip-higher, [1 - eps_low, 1 + eps_high] with eps_high > eps_low: a rare token with A > 0 may grow further before
   the clip stops it, which keeps the policy's entropy from collapsing. No KL term by default (kl_coef 0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from ...config import bad_value
from ...train import Batch
from .. import core
from .grpo import policy_loss
from .registration import Algorithm, Sampled, collect_round, register


@dataclass(kw_only=True)
class DAPOConfig(core.RolloutConfig):
    """DAPO's knobs and the shared ones (`core.RolloutConfig`; `prompts_per_iteration`: groups each update wants)."""

    eps_low: float = 0.2
    """Ratio clip below: the loss stops pushing a token down once ratio < 1 - eps_low."""
    eps_high: float = 0.28
    """Ratio clip above (the paper's 0.28): the loss stops pushing a token up once ratio > 1 + eps_high."""
    max_sampling_rounds: int = 4
    """Sampling rounds per iteration at most (1 = filter only, never refill)."""


def dapo_loss(mb: Batch, token_losses: torch.Tensor, *, eps_low: float, eps_high: float, kl_coef: float = 0.0):
    """megatron loss_func for DAPO: `policy_loss` clipped to [1 - eps_low, 1 + eps_high], per token (docstring, 2-3)."""
    return policy_loss(mb, token_losses, eps_low=eps_low, eps_high=eps_high, kl_coef=kl_coef, level="token")


def informative_groups(rewards: torch.Tensor, *, group_size: int) -> list[int]:
    """Indices of the groups whose rewards are not all equal (max > min): the only ones with A != 0."""
    groups = rewards.view(-1, group_size)
    return (groups.max(dim=1).values > groups.min(dim=1).values).nonzero().flatten().tolist()


def prompts_to_draw(*, wanted_groups: int, kept_groups: int, multiple_of: int) -> int:
    """Prompts for the next round: the missing groups rounded up to `multiple_of` (the data-parallel size, so every
    rank samples the same number); 0 when the batch is full."""
    return math.ceil(max(wanted_groups - kept_groups, 0) / multiple_of) * multiple_of


def usable_groups(available: int, *, group_size: int, sequences_multiple_of: int) -> int:
    """The most groups <= `available` whose sequences split evenly: groups * group_size must be a
    multiple of dp * num_minibatches * micro_batch_size (`sequences_multiple_of`)."""
    unit = math.lcm(group_size, sequences_multiple_of) // group_size
    return available - available % unit


def dynamic_sample(*, sample_round: Callable[[int, int], core.RolloutBatch], wanted_groups: int, max_rounds: int,
                   multiple_of: int) -> tuple[core.RolloutBatch, core.RolloutBatch, int]:
    """Rounds of `sample_round(round, num_prompts)` until `wanted_groups` informative groups are kept or
    `max_rounds` ran. Returns (kept groups, at most `wanted_groups`; everything sampled; rounds run)."""
    if max_rounds < 1:
        raise bad_value("max_sampling_rounds", max_rounds, "an integer >= 1 (1 = filter only, never refill)")
    kept, sampled = [], []   # a RolloutBatch per round
    for r in range(max_rounds):
        k = prompts_to_draw(wanted_groups=wanted_groups, kept_groups=sum(b.num_groups for b in kept),
                            multiple_of=multiple_of)
        if k == 0:
            break
        batch = sample_round(r, k)
        sampled.append(batch)
        kept.append(batch.select_groups(informative_groups(batch.rewards, group_size=batch.group_size)))
    everything, kept_all = core.concat(sampled), core.concat(kept)
    return kept_all.select_groups(list(range(min(kept_all.num_groups, wanted_groups)))), everything, len(sampled)


def dynamic_sampling(models, cfg: DAPOConfig, *, draw, reward, index: int) -> Sampled:
    """DAPO's filter (module docstring, 1) over prompts from `draw(k)`."""
    from megatron.core import parallel_state as ps
    dp = ps.get_data_parallel_world_size()
    kept, sampled, rounds = dynamic_sample(
        sample_round=lambda r, k: collect_round(models, cfg, prompts=draw(k), reward=reward, index=index, round=r),
        wanted_groups=cfg.prompts_per_iteration, max_rounds=cfg.max_sampling_rounds, multiple_of=dp)
    n_use = usable_groups(kept.num_groups, group_size=cfg.samples_per_prompt,
                          sequences_multiple_of=dp * cfg.num_minibatches * cfg.micro_batch_size)
    return Sampled(everything=sampled, kept=kept.select_groups(list(range(n_use))),
                   metrics=dict(groups_sampled=sampled.num_groups, groups_kept=n_use, sampling_rounds=rounds))


def clip_higher_loss(cfg: DAPOConfig):
    """`dapo_loss` with `cfg`'s eps_low, eps_high and kl_coef."""
    return partial(dapo_loss, eps_low=cfg.eps_low, eps_high=cfg.eps_high, kl_coef=cfg.kl_coef)


DAPO = register(Algorithm(name="dapo", config=DAPOConfig, loss=clip_higher_loss, sample=dynamic_sampling))
