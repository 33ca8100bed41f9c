"""Rollouts decoupled from training: rollout processes sample while the trainer updates, joined by a `weights.push.Link`.

The synchronous loop (`loop.fit`) alternates on the same ranks: sync weights, sample iteration k, update on it. Here
the roles are apart (docs/design.md, "MoE router replay and decoupled rollouts"): the trainer ranks (the usual world,
megatron) run `fit`; each rollout process (no world: a `ContinuousRollout` or `HFRollout` of the same HF
architecture) runs `serve`. Both follow one schedule, fixed by `max_staleness` (s):

    rollout iteration j samples with policy version needed(j) = max(0, j - s)   (version: the trainer's updates so far)
    the trainer pushes version v (`push.send`, a broadcast over the link) once v is some needed(j), and updates on
    iteration k's samples at version k: their staleness is k - needed(k) = min(k, s) <= s

s = 0 is the synchronous loop through the link (the same samples and updates on the same seeds); s = 1 is one-step
off-policy (rollout k+1 runs with version k while the trainer updates on iteration k's samples, verl's one-step-off);
s > 1 lets the rollouts run up to s iterations ahead (bounded-staleness async). The rollout correction
(`RolloutConfig.rollout_correction`: pi_old / q per token, `rl.correction`) then weighs each token by the trainer's
current policy over the behaviour policy whose log-probs the rollout recorded. Samples travel back through the
link's store, pickled (key `samples{j}/{r}`, deleted once read): the trainer reads iteration k's before it can push
the version iteration k + s + 1 needs, so at most s + 1 iterations' samples wait there. Every sample carries its
version (`RolloutBatch.versions`); the trainer drops the groups older than s versions (`fresh`) before the update.
"""
from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..config import ConfigError, bad_value
from ..distributed import runtime, stop
from ..distributed.progress import report
from ..fieldtypes import COUNT, INDEX, checked_args, optional
from ..train import chat
from ..weights import push
from . import core, loop
from .algorithms import registration
from .core import RolloutBatch, RolloutConfig

PLAN_KEY = "plan"
"""The link store's key of the trainer's plan (cfg, iterations, max_staleness), read by every rollout process."""


def needed(j: int, max_staleness: int) -> int:
    """The policy version rollout iteration `j` samples with (module docstring)."""
    return max(0, j - max_staleness)


def samples_key(j: int, r: int) -> str:
    """The store key of rollout process `r`'s (link rank, 1..) samples of iteration `j`."""
    return f"samples{j}/{r}"


@dataclass
class History(loop.History):
    """`loop.History` and what the decoupled roles add."""

    policy_version: list[int] = field(default_factory=list)
    """The trainer's version when it updated (its updates so far). `staleness_max` / `staleness_mean` are
    `loop.History`'s, per completion here (`staleness`: its oldest token)."""
    groups_stale: list[int] = field(default_factory=list)
    """Groups dropped for staleness above `max_staleness` (`fresh`)."""
    wait_s: list[float] = field(default_factory=list)
    """Seconds the trainer waited for the iteration's samples."""


# ---- the rollout side: sample and score without collectives ---------------------------------
def sample_scored(backend, cfg: RolloutConfig, *, prompts: list[tuple[str, str]], reward, seed: int,
                  version: int) -> RolloutBatch:
    """`cfg.samples_per_prompt` completions of each of `prompts` from `backend` (seed `seed`), scored by `reward` (a
    `core.Reward` or a callable), every token tagged `version`: what `core.collect` makes of one replica's share,
    with no collective (a rollout process has no world)."""
    reward, n = core.as_reward(reward), cfg.samples_per_prompt
    t0 = time.perf_counter()
    completions, rewards = core.sample_and_reward(backend, prompts, n=n, max_new_tokens=cfg.max_new_tokens,
                                                  temperature=cfg.temperature, top_p=cfg.top_p, seed=seed,
                                                  reward=reward, routes=cfg.router_replay)
    rewards = torch.tensor(rewards)
    return RolloutBatch(prompts=list(prompts), prompt_ids=core.prompt_ids(backend.tokenizer, prompts),
                        completions=list(completions), rewards=rewards, solved=reward.solved(rewards), group_size=n,
                        stats=dict(rollout_s=time.perf_counter() - t0), logprobs=completions.logprobs,
                        model_mask=completions.model_mask, routes=completions.routes if cfg.router_replay else None,
                        versions=[[version] * len(c) for c in completions])


def serve(*, link: push.Link, backend, prompt_pool: list[tuple[str, str]], reward_fn) -> dict:
    """A rollout process's loop (link rank r >= 1): read the trainer's plan from the link's store, then per iteration
    j receive the pushes up to version `needed(j)` into `backend.model`, sample this process's consecutive share of
    the prompts (drawn as `loop.fit` draws them, `core.PromptDraw(prompt_pool, seed=cfg.seed)`; seed
    `core.rollout_seed` + r - 1) and put them in the store. Returns {"versions": the version of each iteration,
    "stopped": None, or why the link closed first (the trainer stopped or failed: `push.LinkClosed`)}. Stop on a
    notebook engine ends it between two iterations; then, as on a failure, the link is closed for the trainer."""
    if link.rank == 0:
        raise ValueError("decoupled.serve: link rank 0 is the trainer's; rollout processes are link ranks 1..")
    plan = pickle.loads(link.store.get(PLAN_KEY))
    cfg, iterations, staleness = plan["cfg"], plan["iterations"], plan["max_staleness"]
    core.check_records_routes(backend, routes=cfg.router_replay)
    draw, per = core.PromptDraw(prompt_pool, seed=cfg.seed), cfg.prompts_per_iteration // (link.size - 1)
    version, versions = -1, []
    try:
        with stop.stoppable():
            for j in range(iterations):
                push.check_open(link)
                if stop.agreed():   # no world here: this process's own Stop
                    stop.record(what="decoupled.serve", step=j, total=iterations)
                    push.close(link, reason=f"rollout process {link.rank} stopped before iteration {j}")
                    break
                while version < needed(j, staleness):
                    version = push.receive(backend.model, link=link)
                share = draw(cfg.prompts_per_iteration)[(link.rank - 1) * per:link.rank * per]
                batch = sample_scored(backend, cfg, prompts=share, reward=reward_fn, version=version,
                                      seed=core.rollout_seed(seed=cfg.seed, iteration=j) + link.rank - 1)
                link.store.set(samples_key(j, link.rank), pickle.dumps(batch))
                versions.append(version)
                report(step=j + 1, total=iterations, version=version)   # a notebook's handle.status() row
    except push.LinkClosed as closed:
        return dict(versions=versions, stopped=str(closed))
    except BaseException as err:
        push.close(link, reason=f"rollout process {link.rank} failed at iteration {len(versions)}: {err!r}")
        raise
    finally:   # a Stop that came here is spent: no notebook reads a rollout engine's record, and `handle.run` cells
        stop.clear()   # (silent) do not clear it as a %%px cell's pre_run_cell does
    return dict(versions=versions, stopped=push.closed(link))


# ---- the trainer side ------------------------------------------------------------------------
def fresh(batch: RolloutBatch, *, version: int, max_staleness: int) -> tuple[RolloutBatch, int]:
    """`batch`'s groups none of whose tokens is more than `max_staleness` versions older than `version`, and how
    many groups were dropped (a group's advantages are relative to each other: a group stays whole or goes)."""
    if batch.versions is None:
        raise bad_value("RolloutBatch.versions", None, "a version per token (`decoupled.sample_scored` tags them)")
    n = batch.group_size
    oldest = [min(v, default=version) for v in batch.versions]
    keep = [g for g in range(batch.num_groups) if version - min(oldest[g * n:(g + 1) * n]) <= max_staleness]
    return (batch if len(keep) == batch.num_groups else batch.select_groups(keep)), batch.num_groups - len(keep)


def staleness(batch: RolloutBatch, *, version: int) -> dict:
    """staleness_max and staleness_mean (`History`) of `batch` at the trainer's `version`."""
    per_row = [version - min(v, default=version) for v in batch.versions]
    return dict(staleness_max=max(per_row), staleness_mean=sum(per_row) / len(per_row))


def _checked(cfg: RolloutConfig, link: push.Link | None) -> None:
    """Refused before any work: what the decoupled roles cannot run."""
    if registration.of(cfg).sample is not registration.sample_once:
        raise ConfigError(f"cfg={type(cfg).__qualname__}(...) is not allowed; allowed: an algorithm that samples "
                          f"once per iteration (GRPO, RLOO, REINFORCE++, PPO): the rollout processes do not rerun "
                          f"a filter's rounds")
    if cfg.offload_during_rollout:
        raise bad_value("offload_during_rollout", True, "False: the rollouts run in processes of their own")
    rank = dist.get_rank()
    if (link is not None) != (rank == 0) or (link is not None and link.rank != 0):
        raise bad_value("link", link, "the link of link rank 0 on trainer rank 0, None on the other trainer ranks")
    if link is not None and cfg.prompts_per_iteration % (link.size - 1):
        raise bad_value("prompts_per_iteration", cfg.prompts_per_iteration,
                        f"a multiple of the {link.size - 1} rollout processes")


def _samples(link: push.Link | None, j: int) -> RolloutBatch | None:
    """Iteration `j`'s samples from every rollout process (trainer rank 0 reads the store), on every trainer rank;
    None when Stop came meanwhile. Raises `push.LinkClosed` on every trainer rank when a rollout process closed
    the link (it stopped or failed) before they came."""
    got = None
    if link is not None:
        try:
            taken = [_take(link, samples_key(j, r)) for r in range(1, link.size)]
            got = None if None in taken else core.concat(taken)
        except push.LinkClosed as closed:
            got = str(closed)
    got = runtime.broadcast(got)   # rank 0's, on every trainer rank
    if isinstance(got, str):
        raise push.LinkClosed(got)
    return got


def _take(link: push.Link, key: str, *, poll_s: float = 0.05) -> RolloutBatch | None:
    """The batch under `key` once it is there (then deleted); None if Stop came first. Polled, not a blocking get:
    a Stop (a Python signal handler) or a closed link must not wait for a rollout that may never come."""
    while not link.store.check([key]):
        push.check_open(link)
        if stop.requested():
            return None
        time.sleep(poll_s)
    batch = pickle.loads(link.store.get(key))
    link.store.delete_key(key)
    return batch


@checked_args(iterations=COUNT, max_staleness=INDEX, seq_len_tokens=optional(COUNT))
def fit(*, models: loop.Models, cfg: RolloutConfig, link: push.Link | None, tokenizer,
        prompt_pool: list[tuple[str, str]], iterations: int, max_staleness: int = 1, seq_len_tokens: int | None = None,
        progress: bool = True, on_iteration=None) -> History:
    """The trainer's loop (every trainer rank; `link` on rank 0, None elsewhere): publish the plan, push version 0,
    then per iteration k take the samples, drop groups older than `max_staleness` versions (`fresh`), update on them
    (`loop.learn`) and push the new version when a rollout iteration still needs it. `models.rollout` is not read
    (None); `tokenizer` is the rollouts' (pad id, the length check as `loop.fit` does it over `prompt_pool`)."""
    _checked(cfg, link)
    seq_len_tokens = core.checked_seq_len(seq_len_tokens, prompt_pool, tokenizer, max_new_tokens=cfg.max_new_tokens)
    pad_id, last = chat.pad_id(tokenizer), needed(iterations - 1, max_staleness)
    if link is not None:
        link.store.set(PLAN_KEY, pickle.dumps(dict(cfg=cfg, iterations=iterations, max_staleness=max_staleness)))
    pushed = push.send(models.chunks, models.bridge, link=link, version=0)

    def iteration(k: int) -> dict | None:
        nonlocal pushed
        t0 = time.perf_counter()
        everything = _samples(link, k)
        if everything is None:   # Stop while waiting for them: the loop ends here (`loop.run_iterations`)
            return None
        wait_s = time.perf_counter() - t0
        kept, dropped = fresh(everything, version=k, max_staleness=max_staleness)
        m = loop.learn(registration.Sampled(everything=everything, kept=kept), models=models, cfg=cfg,
                       seq_len_tokens=seq_len_tokens, pad_id=pad_id)
        m.update(policy_version=k, groups_stale=dropped, wait_s=wait_s, sync_s=pushed["seconds"],
                 sync_bytes=pushed["bytes"], **staleness(everything, version=k))
        if k + 1 <= last:
            pushed = push.send(models.chunks, models.bridge, link=link, version=k + 1)
        else:
            pushed = dict(seconds=0.0, bytes=0)   # no rollout iteration needs a newer version
        return m

    try:
        history = loop.run_iterations(iteration=iteration, iterations=iterations, history=History(),
                                      desc=f"{registration.of(cfg).name} (decoupled)", progress=progress,
                                      on_iteration=on_iteration)
    except BaseException as err:
        if link is not None:   # the rollout processes must not wait for pushes that will not come
            push.close(link, reason=f"the trainer failed: {err!r}")
        raise
    if link is not None and len(history.policy_version) < iterations:   # Stop
        push.close(link, reason=f"the trainer stopped after {len(history.policy_version)} of {iterations} "
                                "iterations")
    return history
