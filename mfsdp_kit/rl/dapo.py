"""DAPO (Yu et al. 2025) as three changes to GRPO, each a small function on top of `rl.core`:

1. Dynamic sampling. A group whose n rewards are all equal has A = 0 for every sample
   (`core.group_advantages`): it costs a forward/backward and moves nothing, and a batch full of
   such groups (all solved, or all failed) gives a tiny, noisy gradient. DAPO drops those groups
   (`informative_groups`) and samples more prompts (`prompts_to_draw`: the missing groups,
   rounded up to the data-parallel size) until the batch holds `prompts_per_iteration` groups or
   `max_sampling_rounds` rounds have run (`dynamic_sample`). What is left is trimmed to a size the
   minibatch / micro-batch split accepts (`usable_groups`); none left -> no update this iteration.
2. Token-level loss. The loss is the sum over all completion tokens of all sequences divided by
   their total count, L = sum_i sum_t l_it / sum_i |o_i|, not the mean of per-sequence means
   (1/G) sum_i (1/|o_i|) sum_t l_it, so every token weighs the same and a long wrong answer
   is pushed down in proportion to its length (`core.aggregate`, level "token").
3. Clip-higher. The ratio clip is [1 - eps_low, 1 + eps_high] with eps_high > eps_low: a
   low-probability token with A > 0 may grow further before the clip stops it, which keeps the
   policy's entropy from collapsing.

DAPO also drops the KL term (kl_coef 0 by default here; a reference model still works).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from ..train import chat
from . import core, correction, grpo, loop
from .core import RolloutBatch
from .rollout import RolloutBackend
from ..config import bad_value
from ..fieldtypes import COUNT, checked_args, optional
from ..train.data import Batch


@dataclass(kw_only=True)
class DAPOConfig(core.RolloutConfig):
    """Knobs of one DAPO run: the shared ones (`core.RolloutConfig`; `prompts_per_iteration` is the
    number of groups wanted in each update, and the first round's prompts) and DAPO's own."""

    eps_low: float = 0.2
    """Ratio clip below: the loss stops pushing a token down once ratio < 1 - eps_low."""
    eps_high: float = 0.28
    """Ratio clip above (the paper's 0.28): the loss stops pushing a token up once ratio > 1 + eps_high."""
    max_sampling_rounds: int = 4
    """Sampling rounds per iteration at most (1 = filter only, never refill)."""


def dapo_loss(mb: Batch, token_losses: torch.Tensor, *, eps_low: float, eps_high: float, kl_coef: float = 0.0):
    """megatron loss_func for DAPO: `grpo.policy_loss` with the clip [1 - eps_low, 1 + eps_high],
    always averaged per token over the minibatch (module docstring, 2 and 3)."""
    return grpo.policy_loss(mb, token_losses, eps_low=eps_low, eps_high=eps_high, kl_coef=kl_coef, level="token")


def informative_groups(rewards: torch.Tensor, *, group_size: int) -> list[int]:
    """Indices of the groups whose rewards are not all equal (max > min): the only ones with A != 0."""
    groups = rewards.view(-1, group_size)
    return (groups.max(dim=1).values > groups.min(dim=1).values).nonzero().flatten().tolist()


def prompts_to_draw(*, wanted_groups: int, kept_groups: int, multiple_of: int) -> int:
    """Prompts for the next round: the missing groups rounded up to `multiple_of` (the
    data-parallel size, so every rank samples the same number); 0 when the batch is full."""
    missing = max(wanted_groups - kept_groups, 0)
    return math.ceil(missing / multiple_of) * multiple_of


def usable_groups(available: int, *, group_size: int, sequences_multiple_of: int) -> int:
    """The most groups <= `available` whose sequences split evenly: groups * group_size must be a
    multiple of dp * num_minibatches * micro_batch_size (`sequences_multiple_of`)."""
    unit = math.lcm(group_size, sequences_multiple_of) // group_size
    return available - available % unit


def dynamic_sample(*, sample_round: Callable[[int, int], RolloutBatch], wanted_groups: int, max_rounds: int,
                   multiple_of: int) -> tuple[RolloutBatch, RolloutBatch, int]:
    """Rounds of `sample_round(round, num_prompts)` until `wanted_groups` informative groups are
    kept or `max_rounds` ran. Returns (kept groups, at most `wanted_groups`; everything sampled;
    rounds run)."""
    if max_rounds < 1:
        raise bad_value("max_sampling_rounds", max_rounds, "an integer >= 1 (1 = filter only, never refill)")
    kept: list[RolloutBatch] = []
    sampled: list[RolloutBatch] = []
    for r in range(max_rounds):
        k = prompts_to_draw(wanted_groups=wanted_groups, kept_groups=sum(b.num_groups for b in kept),
                            multiple_of=multiple_of)
        if k == 0:
            break
        batch = sample_round(r, k)
        sampled.append(batch)
        kept.append(batch.select_groups(informative_groups(batch.rewards, group_size=batch.group_size)))
    everything = core.concat(sampled)
    kept_all = core.concat(kept)
    return kept_all.select_groups(list(range(min(kept_all.num_groups, wanted_groups)))), everything, len(sampled)


@dataclass
class DAPOHistory(grpo.GRPOHistory):
    """GRPO's per-iteration metrics (reward and accuracy over everything sampled) plus the filter's."""

    groups_sampled: list[int] = field(default_factory=list)
    groups_kept: list[int] = field(default_factory=list)
    """Groups in the update (0: no update that iteration; kl, clip_frac, entropy are NaN)."""
    sampling_rounds: list[int] = field(default_factory=list)


def iteration(*, chunks, optimizer, bridge, rollout: RolloutBackend, draw_prompts: Callable[[int], list], reward_fn,
              dcfg: DAPOConfig, seq_len_tokens: int, ref_chunks=None, index: int = 0, scheduler=None) -> dict:
    """One DAPO iteration: dynamic sampling (prompts from `draw_prompts(k)`, same on every rank),
    then GRPO's advantages / log-probs / update from `rl.core` with `dapo_loss`."""
    from megatron.core import parallel_state as ps
    dp = ps.get_data_parallel_world_size()

    def sample_round(r: int, k: int) -> RolloutBatch:
        return core.collect(chunks=chunks, bridge=bridge, backend=rollout, prompts=draw_prompts(k),
                            reward=core.as_reward(reward_fn), samples_per_prompt=dcfg.samples_per_prompt,
                            max_new_tokens=dcfg.max_new_tokens, temperature=dcfg.temperature, top_p=dcfg.top_p,
                            seed=core.rollout_seed(seed=dcfg.seed, iteration=index, round=r), refresh=r == 0,
                            offload_optimizer=optimizer if dcfg.offload_during_rollout else None)
    kept, sampled, rounds = dynamic_sample(sample_round=sample_round, wanted_groups=dcfg.prompts_per_iteration,
                                           max_rounds=dcfg.max_sampling_rounds, multiple_of=dp)
    n_use = usable_groups(kept.num_groups, group_size=dcfg.samples_per_prompt,
                          sequences_multiple_of=dp * dcfg.num_minibatches * dcfg.micro_batch_size)
    metrics = dict(**sampled.stats, **core.rollout_metrics(sampled), groups_sampled=sampled.num_groups,
                   groups_kept=n_use, sampling_rounds=rounds)
    if n_use == 0:
        nan = math.nan
        return dict(metrics, logprob_s=0.0, update_s=0.0, train_s=0.0, logprob_passes=0, kl=nan, clip_frac=nan,
                    entropy=nan, loss=nan, logprob_diff_mean=nan, logprob_diff_max=nan, **dict.fromkeys(correction.KEYS, nan))
    loss_fn = partial(dapo_loss, eps_low=dcfg.eps_low, eps_high=dcfg.eps_high, kl_coef=dcfg.kl_coef)
    return dict(metrics, **loop.policy_update(kept.select_groups(list(range(n_use))), chunks=chunks,
                                              optimizer=optimizer, cfg=dcfg, loss_fn=loss_fn,
                                              seq_len_tokens=seq_len_tokens, pad_id=chat.pad_id(rollout.tokenizer),
                                              ref_chunks=ref_chunks, scheduler=scheduler))


@checked_args(iterations=COUNT, seq_len_tokens=optional(COUNT))
def fit(*, chunks, optimizer, bridge, rollout: RolloutBackend, prompt_pool: list[tuple[str, str]], reward_fn,
        dcfg: DAPOConfig, iterations: int, seq_len_tokens: int | None = None, ref_chunks=None,
        progress: bool = True, on_iteration=None, scheduler=None) -> DAPOHistory:
    """`iterations` DAPO iterations drawing prompts from `prompt_pool` (`core.PromptDraw`, seeded by
    `dcfg.seed`); `on_iteration`, `scheduler` and `seq_len_tokens` as in `grpo.fit`."""
    def one(*, index: int, draw, seq_len_tokens: int) -> dict:
        return iteration(chunks=chunks, optimizer=optimizer, bridge=bridge, rollout=rollout, draw_prompts=draw,
                         reward_fn=reward_fn, dcfg=dcfg, seq_len_tokens=seq_len_tokens, ref_chunks=ref_chunks,
                         index=index, scheduler=scheduler)
    return loop.fit(iteration=one, cfg=dcfg, prompt_pool=prompt_pool, tokenizer=rollout.tokenizer,
                    iterations=iterations, seq_len_tokens=seq_len_tokens, history=DAPOHistory(), desc="dapo",
                    progress=progress, on_iteration=on_iteration)
