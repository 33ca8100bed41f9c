"""What GRPO and DAPO share after sampling, and their outer loop: each algorithm keeps only its loss and how it
picks the groups it trains on (`grpo.iteration`, `dapo.iteration`).

    policy_update   advantages -> training batch with old / reference log-probs (timed: logprob_s; pi_old from the
                    update's own forward when it is one optimizer step, `rl.on_policy`) -> update (update_s),
                    all scored at the sampling temperature (`scoring.scored_at`), plus the train-inference
                    mismatch of the rollout's log-probs (`scoring.mismatch`)
    fit             prompts drawn from a pool each iteration (`core.PromptDraw`), the training length checked
                    before any rollout, metrics into a history (`run_iterations`)
"""
from __future__ import annotations

import time
from typing import Callable

from ..fieldtypes import COUNT, checked_args
from ..perf.timeline import phase
from . import advantages, core, correction, on_policy
from .core import RolloutBatch, RolloutConfig
from .scoring import mismatch, scored_at


def policy_update(kept: RolloutBatch, *, chunks, optimizer, cfg: RolloutConfig, loss_fn, seq_len_tokens: int,
                  pad_id: int, ref_chunks=None, scheduler=None, min_advantage: float | None = None,
                  precomputed_advantages=None) -> dict:
    """Advantages of `kept` (`cfg.advantage_estimator`, or `precomputed_advantages`: [n], or [n, seq] in the training
    batch's layout such as PPO's GAE; raised to `min_advantage` if given), its training batch and
    log-probs, weighted by `cfg.rollout_correction` (`rl.correction`), and `cfg`'s epochs x minibatches of
    optimizer steps with `loss_fn`.
    pi_old comes from the update's own forward when it is one optimizer step (`rl.on_policy`), else from a
    separate pass first (logprob_s; with a reference model, its pass is there too).
    Returns logprob_s, update_s, train_s (their sum), logprob_passes, logprob_diff_mean/max, the correction's
    diagnostics and the last step's loss, kl, clip_frac and entropy."""
    adv = (advantages.estimate(kept.rewards, group_size=cfg.samples_per_prompt, estimator=cfg.advantage_estimator)
           if precomputed_advantages is None else precomputed_advantages)
    if min_advantage is not None:
        adv = adv.clamp(min=min_advantage)
    models = list(chunks) + list(ref_chunks or [])
    in_loss = on_policy.applies(cfg)
    correction.needed(cfg.rollout_correction, kept.logprobs)   # refused before any forward
    with scored_at(models, temperature=cfg.temperature if cfg.score_at_temperature else 1.0):
        t0 = time.perf_counter()
        with phase("logprobs"):
            batch = core.training_batch(kept, adv, chunks=chunks, ref_chunks=ref_chunks, seq_len_tokens=seq_len_tokens,
                                        pad_id=pad_id, micro_batch_size=cfg.micro_batch_size, packed=cfg.packed,
                                        old=not in_loss)
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
                                  num_minibatches=cfg.num_minibatches, micro_batch_size=cfg.micro_batch_size,
                                  scheduler=scheduler, loss_fn=loss_fn, packed=cfg.packed,
                                  max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch)
    t2 = time.perf_counter()
    if in_loss:
        from megatron.core import parallel_state as ps
        stats = loss_fn.stats(group=ps.get_data_parallel_group())
    else:
        stats = dict(**drift, **weighted)
    passes = int(not in_loss) + int(ref_chunks is not None)
    return dict(logprob_s=t1 - t0, update_s=t2 - t1, train_s=t2 - t0, logprob_passes=passes, **stats,
                **core.update_metrics(results))


def fit(*, iteration: Callable[..., dict], cfg: RolloutConfig, prompt_pool: list[tuple[str, str]], tokenizer,
        iterations: int, seq_len_tokens: int | None, history, desc: str, progress: bool = True, on_iteration=None):
    """`iterations` calls of `iteration(index=, draw=, seq_len_tokens=)`, where `draw(k)` gives k prompts of
    `prompt_pool` (deterministic from `cfg.seed`) and `seq_len_tokens` is checked (None: what the longest prompt
    plus `max_new_tokens` needs) before any rollout."""
    seq_len_tokens = core.checked_seq_len(seq_len_tokens, prompt_pool, tokenizer, max_new_tokens=cfg.max_new_tokens)
    draw = core.PromptDraw(prompt_pool, seed=cfg.seed)
    return run_iterations(iteration=lambda it: iteration(index=it, draw=draw, seq_len_tokens=seq_len_tokens),
                          iterations=iterations, history=history, desc=desc, progress=progress,
                          on_iteration=on_iteration)


@checked_args(iterations=COUNT)
def run_iterations(*, iteration: Callable[[int], dict], iterations: int, history, desc: str, progress: bool = True,
                   on_iteration=None):
    """Call `iteration(i)` for i < iterations; append each metric named by a `history` field to it;
    tqdm bar and `progress.report` on rank 0; `on_iteration(i, metrics)` on every rank after each. On a notebook
    engine Stop ends the loop between two iterations (an iteration under way, its rollout included, finishes
    first), the same one on every rank (`distributed.stop`); the history so far is returned."""
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
            for key in vars(history):
                getattr(history, key).append(m[key])
            bar.set_postfix(reward=f"{m['reward']:.3f}", kl=f"{m['kl']:.4f}")
            report(step=it + 1, total=iterations, reward=m["reward"], kl=m["kl"])
            if on_iteration is not None:
                on_iteration(it, m)
    bar.close()
    return history
