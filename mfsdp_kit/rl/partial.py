"""Partial rollouts (verl's `partial_rollout`, slime's `--partial-rollout`, AReaL's interruptible rollouts): an
iteration's sampling stops once enough groups are complete; the rows still running are kept and continued next
iteration, after the weight refresh, from their last token.

The naive loop samples every group of an iteration to its end, so every iteration waits for its longest completion
(the long tail of the length distribution). Here, with `RolloutConfig.partial_fraction` f and `max_staleness` s, P =
`prompts_per_iteration` and the current policy's version v (the iteration's index: the synchronous loop's convention,
one policy update per iteration):

    pool     the groups in flight (`Pool`, the same on every rank): those carried from the last iteration first,
             then new prompts drawn to fill it to N = P / f groups (rounded up to a multiple of the data-parallel
             size), the carried ones dealt round-robin to the data-parallel replicas (`dealing`)
    drop     a row holding a token older than v - s is emptied and starts again from its prompt (stale_rows_dropped);
             its group stays in the pool, so groups always have `samples_per_prompt` rows
    sample   each data-parallel replica continues the unfinished rows of its share of the pool (prompt + its tokens
             so far, re-prefilled with the new weights, each with what is left of `max_new_tokens`) and stops at the
             first check point where its share holds P * share / N complete groups (`ContinuousRollout.generate_turns`'
             `enough_groups`); a row's reward is computed where it ends
    train    the first P complete groups in pool order (the oldest first): every iteration trains on exactly P groups,
             and the others, complete or not, stay in the pool for the next

Every token keeps the log-prob it was sampled with (the behaviour policy's q, recorded then) and its policy version
(`RolloutBatch.versions`). The rollout correction (`rl.correction`, TIS/MIS) then weighs each token by pi_old / q with
its own q, which for a token of an older policy corrects its staleness as well as the engine's numerics; the drop
bounds the staleness of every trained token by s.
"""
from __future__ import annotations

import inspect
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..config import bad_value
from ..distributed import stop
from ..perf.timeline import phase
from . import core
from .algorithms import registration
from .algorithms.registration import Models, Sampled
from .core import Reward, RolloutBatch, RolloutConfig
from .rollout.placement import ReplicaPlacement


@dataclass(kw_only=True)
class Row:
    """One completion in flight: what it has sampled so far, across iterations."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Each token's log-prob as the rollout sampled it (the behaviour policy's, at the sampling temperature)."""
    versions: list[int] = field(default_factory=list)
    """Each token's policy version (the iteration that sampled it)."""
    ended: bool = False
    """At a stop id or at `max_new_tokens`: its tokens are final."""
    reward: float = math.nan
    """Its reward, once ended."""


@dataclass(kw_only=True)
class Group:
    """A prompt's `samples_per_prompt` rows."""

    prompt: tuple[str, str]
    """(prompt, answer)."""
    prompt_ids: list[int]
    rows: list[Row]

    def complete(self) -> bool:
        return all(r.ended for r in self.rows)


@dataclass
class Pool:
    """What partial rollouts keep between iterations, the same on every rank: the groups in flight, oldest first."""

    groups: list[Group] = field(default_factory=list)

    def drop_stale(self, *, version: int, max_staleness: int) -> int:
        """Empty every row holding a token more than `max_staleness` versions older than `version` (it starts again
        from its prompt); returns how many."""
        dropped = 0
        for g in self.groups:
            for i, r in enumerate(g.rows):
                if r.versions and version - min(r.versions) > max_staleness:
                    g.rows[i], dropped = Row(), dropped + 1
        return dropped

    def fill(self, draw: Callable[[int], list], *, size: int, group_size: int, tokenizer) -> int:
        """New prompts from `draw(k)` after the groups carried, up to `size` groups; returns how many were carried."""
        carried = len(self.groups)
        fresh = draw(size - carried) if size > carried else []
        ids = core.prompt_ids(tokenizer, fresh) if fresh else []
        self.groups += [Group(prompt=p, prompt_ids=i, rows=[Row() for _ in range(group_size)])
                        for p, i in zip(fresh, ids)]
        return carried

    def take(self, k: int) -> list[Group]:
        """The first `k` complete groups (the oldest first), out of the pool."""
        done = set([i for i, g in enumerate(self.groups) if g.complete()][:k])
        taken = [g for i, g in enumerate(self.groups) if i in done]
        self.groups = [g for i, g in enumerate(self.groups) if i not in done]
        return taken


def pool_size(cfg: RolloutConfig, *, dp: int) -> int:
    """N: `prompts_per_iteration / partial_fraction` groups, rounded up to a multiple of `dp` (module docstring)."""
    return math.ceil(cfg.prompts_per_iteration / cfg.partial_fraction / dp) * dp


def dealing(n: int, *, carried: int, dp: int) -> list[int]:
    """The pool's `n` groups (the first `carried` of them from earlier iterations) in the order whose consecutive
    shares (`ReplicaPlacement.share`) give replica r the carried groups r, r + dp, ..., then new ones in pool order:
    the carried groups and their long tails are spread over the replicas, not all on the first. With none carried,
    the pool's own order (the synchronous loop's split)."""
    per, fresh = n // dp, iter(range(carried, n))
    order = []
    for r in range(dp):
        mine = list(range(r, carried, dp))
        order += mine + [next(fresh) for _ in range(per - len(mine))]
    return order


def check(models: Models, cfg: RolloutConfig) -> None:
    """Refuse, before any work, what partial rollouts cannot continue: another sampler than `sample_once` (DAPO's
    dynamic sampling), a backend other than the kit's engine, tools."""
    algorithm = registration.of(cfg)
    if algorithm.sample is not registration.sample_once:
        raise bad_value("partial_fraction", cfg.partial_fraction, f"None for {algorithm.name} (its own sampling "
                        "filter); partial rollouts sample once per iteration (GRPO, RLOO, REINFORCE++, PPO)")
    generate = getattr(models.rollout, "generate_turns", None)
    if generate is None or "enough_groups" not in inspect.signature(generate).parameters:
        raise bad_value("partial_fraction", cfg.partial_fraction, "None, or the kit's engine (ContinuousRollout) as "
                        "the rollout backend: it continues rows from their tokens")
    if getattr(models.rollout, "tools", None) is not None:
        raise bad_value("partial_fraction", cfg.partial_fraction, "None with tools (a row cut mid-call would lose "
                        "its tool turn)")


@stop.stoppable(then_interrupt="a rollout")   # it holds collectives: Stop lets it finish
def sample(models: Models, cfg: RolloutConfig, *, pool: Pool, draw: Callable[[int], list], reward: Reward,
           index: int) -> Sampled:
    """One iteration of partial rollouts (module docstring) at policy version `index`: `pool` is updated in place;
    the trained groups are returned with their staleness metrics."""
    from megatron.core import parallel_state as ps
    check(models, cfg)
    core.no_pipeline()
    size = pool_size(cfg, dp=ps.get_data_parallel_world_size())
    dropped = pool.drop_stale(version=index, max_staleness=cfg.max_staleness)
    carried = pool.fill(draw, size=size, group_size=cfg.samples_per_prompt, tokenizer=models.rollout.tokenizer)
    resumed = sum(bool(r.tokens) and not r.ended for g in pool.groups for r in g.rows)
    stats = core.synced(chunks=models.chunks, bridge=models.bridge, backend=models.rollout)
    t0 = time.perf_counter()
    with phase("rollout"), core.offloaded(models.chunks, models.optimizer) if cfg.offload_during_rollout else \
            nullcontext():
        pool.groups = spread(models.rollout, pool.groups, carried=carried, cfg=cfg, version=index, reward=reward)
    stats["rollout_s"] = time.perf_counter() - t0
    trained = pool.take(cfg.prompts_per_iteration)
    batch = rollout_batch(trained, reward=reward, stats=stats)
    return Sampled(everything=batch, kept=batch, metrics=dict(
        staleness(batch, version=index), groups_kept=len(trained), stale_rows_dropped=dropped, rows_resumed=resumed,
        rows_carried=sum(len(g.rows) for g in pool.groups)))


def spread(backend, groups: list[Group], *, carried: int, cfg: RolloutConfig, version: int,
           reward: Reward) -> list[Group]:
    """Each data-parallel replica advances its share of `groups` (`dealing`; the first `carried` came from earlier
    iterations) until it holds its part of prompts_per_iteration complete groups; all of them gathered, in their
    order, on every rank."""
    from megatron.core import parallel_state as ps
    placement = getattr(backend, "placement", None) or ReplicaPlacement()
    dealt = dealing(len(groups), carried=carried, dp=ps.get_data_parallel_world_size())
    share = placement.share([groups[i] for i in dealt])
    advance(backend, share, cfg=cfg, enough=math.ceil(cfg.prompts_per_iteration * len(share) / len(groups)),
            seed=core.rollout_seed(seed=cfg.seed, iteration=version) + placement.replica(), version=version,
            reward=reward)
    back = [g for part in placement.gather(share) for g in part]
    return [back[dealt.index(i)] for i in range(len(back))]   # pool order again: oldest first


def advance(backend, share: list[Group], *, cfg: RolloutConfig, enough: int, seed: int, version: int,
            reward: Reward) -> None:
    """Continue the unfinished rows of `share` (in place) until `enough` of its groups are complete or every row has
    ended; a row that ends gets its reward here."""
    enough -= sum(g.complete() for g in share)
    todo = [(j, g, r) for j, g in enumerate(share) for r in g.rows if not r.ended]
    if enough <= 0 or not todo:
        return
    tokens, logprobs, _ = backend.generate_turns(
        [g.prompt_ids + r.tokens for _, g, r in todo], max_new_tokens=[cfg.max_new_tokens - len(r.tokens)
                                                                         for *_, r in todo],
        temperature=cfg.temperature, top_p=cfg.top_p, seed=seed, groups=[j for j, *_ in todo], enough_groups=enough)
    for (_, g, r), new, lps, ended in zip(todo, tokens, logprobs, backend.ended):
        r.tokens, r.logprobs, r.versions = r.tokens + new, r.logprobs + lps, r.versions + [version] * len(new)
        r.ended = ended
        if ended:
            r.reward = float(reward(g.prompt[0], backend.tokenizer.decode(r.tokens)))


def rollout_batch(groups: list[Group], *, reward: Reward, stats: dict) -> RolloutBatch:
    """The complete `groups` as the `RolloutBatch` the loop trains on, with each token's log-prob and version."""
    rows = [r for g in groups for r in g.rows]
    rewards = torch.tensor([r.reward for r in rows])
    return RolloutBatch(prompts=[g.prompt for g in groups], prompt_ids=[g.prompt_ids for g in groups],
                        completions=[r.tokens for r in rows], rewards=rewards, solved=reward.solved(rewards),
                        group_size=len(groups[0].rows) if groups else 0, stats=stats,
                        logprobs=[r.logprobs for r in rows], versions=[r.versions for r in rows])


def staleness(batch: RolloutBatch, *, version: int) -> dict:
    """Over the batch's tokens, version - the token's version: mean, max, the share of tokens an older policy
    sampled (off_policy_token_frac), and the tokens at each lag 0, 1, ..., max (staleness_tokens: a histogram)."""
    lag = torch.tensor([version - v for row in batch.versions for v in row], dtype=torch.long)
    if lag.numel() == 0:
        return dict(staleness_mean=math.nan, staleness_max=0, off_policy_token_frac=math.nan, staleness_tokens=[])
    return dict(staleness_mean=lag.double().mean().item(), staleness_max=int(lag.max()),
                off_policy_token_frac=(lag > 0).double().mean().item(), staleness_tokens=torch.bincount(lag).tolist())
