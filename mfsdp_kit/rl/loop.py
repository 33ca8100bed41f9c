"""The one RL loop: every algorithm's `iteration` and `fit`, reading the registration of the config it is given
(`rl.algorithms`: its filter, its advantage estimator, its loss).

    iteration       sample (the algorithm's filter: `Sampled`) -> advantages (its estimator: `Estimate`) ->
                    `policy_update` with its loss -> what the estimator runs after (PPO: the critic's update)
    policy_update   the training batch with old / reference log-probs (timed: logprob_s; pi_old from the update's own
                    forward when it is one optimizer step, `rl.on_policy`) -> update (update_s), all scored at the
                    sampling temperature (`scoring.scored_at`), plus the train-inference mismatch of the rollout's
                    log-probs (`scoring.mismatch`)
    fit             prompts drawn from a pool each iteration (`core.PromptDraw`), the training length checked
                    before any rollout, metrics into a `History` (`run_iterations`); with `partial_fraction`, the
                    groups in flight kept across iterations (`rl.partial`)
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from ..config import bad_value
from ..fieldtypes import COUNT, checked_args, optional
from ..perf.timeline import phase
from ..train import chat
from . import core, correction, on_policy, partial
from .algorithms import registration
from .algorithms.registration import Models  # noqa: F401 (the loop's public name: what fit trains)
from .core import RolloutBatch, RolloutConfig
from .scoring import mismatch, scored_at


@dataclass
class History:
    """Per-iteration metrics of any algorithm; a field the algorithm does not report stays empty."""

    reward: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    response_tokens: list[float] = field(default_factory=list)
    """Mean completion length, tokens."""
    response_tokens_max: list[int] = field(default_factory=list)
    """The longest completion, tokens (a lower bound on the rollout's sequential decode steps)."""
    prompt_tokens: list[float] = field(default_factory=list)
    """Mean prompt length per completion, tokens."""
    tool_call_rate: list[float] = field(default_factory=list)
    """Share of the completions that hold a tool's output (0 without tools: `rollout.tools`)."""
    kl: list[float] = field(default_factory=list)
    clip_frac: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    logprob_diff_mean: list[float] = field(default_factory=list)
    """Train-inference mismatch: mean |logp_rollout - logp_trainer| over the sampled tokens (`rl.scoring`)."""
    logprob_diff_max: list[float] = field(default_factory=list)
    sync_s: list[float] = field(default_factory=list)
    sync_bytes: list[int] = field(default_factory=list)
    rollout_s: list[float] = field(default_factory=list)
    logprob_s: list[float] = field(default_factory=list)
    """Old and reference log-prob forwards."""
    logprob_passes: list[int] = field(default_factory=list)
    """Forward passes over the batch before the update: the old policy's (none when the update's own forward
    gives pi_old, `rl.on_policy`) and the reference model's."""
    update_s: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    """logprob_s + update_s."""
    is_weight_mean: list[float] = field(default_factory=list)
    """Rollout correction (`rl.correction`; NaN without one): the weights pi_old / q before truncation, mean."""
    is_weight_max: list[float] = field(default_factory=list)
    is_changed_frac: list[float] = field(default_factory=list)
    """Share of the sampled tokens truncated or masked."""
    rollout_kl: list[float] = field(default_factory=list)
    """k3 estimate of KL(rollout || trainer) over the sampled tokens."""
    ppl_ratio: list[float] = field(default_factory=list)
    """Perplexity of the sampled tokens under the trainer over the rollout's."""
    groups_sampled: list[int] = field(default_factory=list)
    """DAPO's filter: groups sampled over its rounds (reward and accuracy are over all of them)."""
    groups_kept: list[int] = field(default_factory=list)
    """Groups in the update (0: no update that iteration; kl, clip_frac, entropy are NaN)."""
    sampling_rounds: list[int] = field(default_factory=list)
    value_loss: list[float] = field(default_factory=list)
    """PPO's critic: the clipped value loss, mean over the iteration's critic steps."""
    value_clip_frac: list[float] = field(default_factory=list)
    """Share of the critic's tokens whose new value left the clip range (mean over its steps)."""
    explained_variance: list[float] = field(default_factory=list)
    """1 - Var(R - V) / Var(R) of the values the advantages came from (before this iteration's critic update)."""
    value_mean: list[float] = field(default_factory=list)
    """Mean V over the completion tokens."""
    advantage_abs_mean: list[float] = field(default_factory=list)
    """Mean |A| over the completion tokens, before whitening."""
    critic_s: list[float] = field(default_factory=list)
    """The critic's forward (values) and update."""
    staleness_mean: list[float] = field(default_factory=list)
    """Policy versions between the one that sampled a token and the one it trains under, mean: over the trained
    tokens with partial rollouts (`rl.partial.staleness`), over the completions' oldest tokens with decoupled
    rollouts (`rl.decoupled.staleness`)."""
    staleness_max: list[int] = field(default_factory=list)
    """Its largest value."""
    staleness_tokens: list[list[int]] = field(default_factory=list)
    """Partial rollouts: trained tokens per staleness, [0 versions behind, 1, ..., staleness_max] (a histogram)."""
    off_policy_token_frac: list[float] = field(default_factory=list)
    """Partial rollouts: share of the trained tokens an older policy sampled."""
    stale_rows_dropped: list[int] = field(default_factory=list)
    """Partial rollouts: rows emptied before sampling, older than `max_staleness` allows (they start again)."""
    rows_resumed: list[int] = field(default_factory=list)
    """Partial rollouts: rows continued from tokens an earlier iteration sampled."""
    rows_carried: list[int] = field(default_factory=list)
    """Partial rollouts: rows left in the pool for the next iteration (of groups complete or not)."""


NO_UPDATE = dict(logprob_s=0.0, update_s=0.0, train_s=0.0, logprob_passes=0, kl=math.nan, clip_frac=math.nan,
                 entropy=math.nan, loss=math.nan, logprob_diff_mean=math.nan, logprob_diff_max=math.nan,
                 **dict.fromkeys(correction.KEYS, math.nan))
"""What an iteration whose filter kept no group reports of the update it did not make."""


def iteration(*, models: Models, cfg: RolloutConfig, draw: Callable[[int], list], reward_fn, seq_len_tokens: int,
              index: int = 0, pool: partial.Pool | None = None) -> dict:
    """One iteration of the algorithm `cfg` registers (module docstring): prompts from `draw(k)` (k prompts, the
    same on every rank), scored by `reward_fn` (a callable or a `core.Reward`, which says what counts as solved:
    `accuracy`); `index` seeds its rollouts (and is the policy's version). With `cfg.partial_fraction`, `pool` (a
    `partial.Pool` kept across iterations) holds the groups in flight (`partial.sample`). Returns the iteration's
    metrics (`History`'s names, and the last step's loss)."""
    algorithm = registration.of(cfg)
    if cfg.partial_fraction is None:
        sampled = algorithm.sample(models, cfg, draw=draw, reward=core.as_reward(reward_fn), index=index)
    elif pool is None:
        raise bad_value("pool", pool, f"a partial.Pool() kept across iterations (partial_fraction="
                        f"{cfg.partial_fraction})")
    else:
        sampled = partial.sample(models, cfg, pool=pool, draw=draw, reward=core.as_reward(reward_fn), index=index)
    pad_id = chat.pad_id(models.rollout.tokenizer) if sampled.kept.num_groups else 0   # 0 groups: no batch is made
    return learn(sampled, models=models, cfg=cfg, seq_len_tokens=seq_len_tokens, pad_id=pad_id)


@checked_args(iterations=COUNT, seq_len_tokens=optional(COUNT))
def fit(*, models: Models, cfg: RolloutConfig, prompt_pool: list[tuple[str, str]], reward_fn, iterations: int,
        seq_len_tokens: int | None = None, progress: bool = True, on_iteration=None) -> History:
    """`iterations` of `iteration`, each drawing its prompts from `prompt_pool` [(prompt, answer)] (deterministic
    from `cfg.seed`, `core.PromptDraw`). With `cfg.partial_fraction`, one `partial.Pool` carries the groups in flight
    from each iteration to the next (`rl.partial`; what partial rollouts cannot continue is refused first).

    `seq_len_tokens` (the training sequences' length): None = what the longest prompt of the pool plus
    `max_new_tokens` needs (`core.seq_len_needed`); a shorter value is refused before any rollout.
    `on_iteration(iteration, metrics)` runs on every rank after each iteration (e.g. a held-out evaluation every k
    iterations; it may run collectives, as all ranks call it). A fresh Adam without warm-up takes sign-like steps of
    the full lr at first, which on CPU at lr 3e-5 cost a small SFT'd model ~5 held-out points in 15 steps even on
    gold SFT data: give `models.scheduler` a warm-up."""
    algorithm = registration.of(cfg)   # a config no algorithm registers: refused before any work
    seq_len_tokens = core.checked_seq_len(seq_len_tokens, prompt_pool, models.rollout.tokenizer,
                                          max_new_tokens=cfg.max_new_tokens)
    draw = core.PromptDraw(prompt_pool, seed=cfg.seed)
    pool = None
    if cfg.partial_fraction is not None:   # refused before any work
        partial.check(models, cfg)
        pool = partial.Pool()
    return run_iterations(iteration=lambda it: iteration(models=models, cfg=cfg, draw=draw, reward_fn=reward_fn,
                                                         seq_len_tokens=seq_len_tokens, index=it, pool=pool),
                          iterations=iterations, history=History(), desc=algorithm.name, progress=progress,
                          on_iteration=on_iteration)


def policy_update(kept: RolloutBatch, *, chunks, optimizer, cfg: RolloutConfig, loss_fn, seq_len_tokens: int,
                  pad_id: int, ref_chunks=None, scheduler=None, advantages=None) -> dict:
    """`kept`'s training batch with `advantages` ([n], or [n, seq] in the training batch's layout such as PPO's GAE;
    None: `cfg.advantage_estimator`'s, `registration.critic_free`) and its log-probs, weighted by
    `cfg.rollout_correction` (`rl.correction`), then `cfg`'s epochs x minibatches of optimizer steps with `loss_fn`.
    pi_old comes from the update's own forward when it is one optimizer step (`rl.on_policy`), else from a
    separate pass first (logprob_s; with a reference model, its pass is there too).
    Returns logprob_s, update_s, train_s (their sum), logprob_passes, logprob_diff_mean/max, the correction's
    diagnostics and the last step's loss, kl, clip_frac and entropy."""
    adv = registration.critic_free(kept, cfg).advantages if advantages is None else advantages
    models = list(chunks) + list(ref_chunks or [])
    in_loss = on_policy.applies(cfg)
    correction.needed(cfg.rollout_correction, kept.logprobs)   # refused before any forward
    with scored_at(models, temperature=cfg.temperature if cfg.score_at_temperature else 1.0):
        t0 = time.perf_counter()
        with phase("logprobs"):
            batch = core.training_batch(kept, adv, chunks=chunks, ref_chunks=ref_chunks, seq_len_tokens=seq_len_tokens,
                                        pad_id=pad_id, options=cfg.scoring_options(), old=not in_loss)
        if in_loss:   # pi_old, the mismatch and the correction from the update's own forward (rl.on_policy)
            loss_fn = on_policy.OnPolicyLoss(loss_fn, mode=cfg.rollout_correction, low=cfg.correction_low,
                                             high=cfg.correction_high)
        else:
            drift = mismatch(kept.logprobs, batch)   # before a correction masks tokens out
            weighted = correction.apply(batch, kept.logprobs, mode=cfg.rollout_correction, low=cfg.correction_low,
                                        high=cfg.correction_high)
        t1 = time.perf_counter()
        with phase("update"):
            results = core.update(chunks=chunks, optimizer=optimizer, batch=batch, epochs=cfg.ppo_epochs,
                                  num_minibatches=cfg.num_minibatches,
                                  options=cfg.step_options(loss_fn=loss_fn, scheduler=scheduler))
    t2 = time.perf_counter()
    if in_loss:
        from megatron.core import parallel_state as ps
        stats = loss_fn.stats(group=ps.get_data_parallel_group())
    else:
        stats = dict(**drift, **weighted)
    passes = int(not in_loss) + int(ref_chunks is not None)
    return dict(logprob_s=t1 - t0, update_s=t2 - t1, train_s=t2 - t0, logprob_passes=passes, **stats,
                **core.update_metrics(results))


@checked_args(iterations=COUNT)
def run_iterations(*, iteration: Callable[[int], dict], iterations: int, history, desc: str, progress: bool = True,
                   on_iteration=None):
    """Call `iteration(i)` for i < iterations; append each metric that names a `history` field to it;
    tqdm bar and `progress.report` on rank 0; `on_iteration(i, metrics)` on every rank after each. On a notebook
    engine Stop ends the loop between two iterations (an iteration under way, its rollout included, finishes
    first), the same one on every rank (`distributed.stop`), or inside one that returns None on every rank for it;
    the history so far is returned."""
    from tqdm.auto import tqdm

    from ..distributed import runtime, stop
    from ..distributed.progress import report
    bar = tqdm(range(iterations), desc=desc, disable=not (progress and runtime.current().rank == 0))
    with stop.stoppable():
        for it in bar:
            if stop.agreed():   # Stop on a notebook engine: between two iterations, the same one on every rank
                stop.record(what=desc, step=it, total=iterations)
                break
            m = iteration(it)
            if m is None:   # the iteration saw Stop before it had anything to learn from (`rl.decoupled`)
                stop.record(what=desc, step=it, total=iterations)
                break
            for key in vars(history):
                if key in m:
                    getattr(history, key).append(m[key])
            bar.set_postfix(reward=f"{m['reward']:.3f}", kl=f"{m['kl']:.4f}")
            report(step=it + 1, total=iterations, reward=m["reward"], kl=m["kl"])
            if on_iteration is not None:
                on_iteration(it, m)
    bar.close()
    return history


def learn(sampled: registration.Sampled, *, models: Models, cfg: RolloutConfig, seq_len_tokens: int,
          pad_id: int) -> dict:
    """The update half of `iteration` (and all of it for samples made elsewhere: `rl.decoupled`'s rollout
    processes): `sampled`'s metrics, then the algorithm's advantages of its kept groups, `policy_update` and what the
    estimator runs after; `NO_UPDATE` when no group is kept. `models.rollout` is not read."""
    algorithm = registration.of(cfg)
    metrics = dict(**sampled.everything.stats, **core.rollout_metrics(sampled.everything), **sampled.metrics)
    if sampled.kept.num_groups == 0:
        return dict(metrics, **NO_UPDATE)
    estimate = algorithm.advantages(sampled.kept, cfg, models=models, seq_len_tokens=seq_len_tokens, pad_id=pad_id)
    policy = policy_update(sampled.kept, advantages=estimate.advantages, chunks=models.chunks,
                           optimizer=models.optimizer, cfg=cfg, loss_fn=algorithm.loss(cfg),
                           seq_len_tokens=seq_len_tokens, pad_id=pad_id, ref_chunks=models.ref_chunks,
                           scheduler=models.scheduler)
    after = estimate.after_update() if estimate.after_update is not None else {}
    return dict(metrics, **estimate.metrics, **policy, **after)
