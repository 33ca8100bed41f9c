"""PPO with a learned critic: GRPO's loop with per-token GAE advantages from a value model, which trains beside it.

One iteration, composed in the open by `iteration` (the same functions as GRPO's, plus the critic's):
  1. collect   as GRPO (`core.collect`): sync, sample, score
  2. values    the critic's V [n, seq] at the completion tokens, no grad (`critic.values`)
  3. GAE       the outcome reward on each completion's last token (`advantages.outcome_rewards`), then
               A_t = delta_t + gamma * lam * A_{t+1}, delta_t = r_t + gamma * V_{t+1} - V_t, returns R = A + V
               (`advantages.gae`), A whitened over the batch's completion tokens (`whiten_advantages`)
  4. policy    `loop.policy_update` with those advantages: old / reference log-probs, then the clipped-ratio loss
               (`grpo.grpo_loss`; it reads [n, seq] advantages as they are) for `ppo_epochs` x `num_minibatches`
  5. critic    the same number of steps of the clipped value loss on (V_old, R) with its own optimizer
               (`critic.update`)

What PPO changes relative to GRPO is the advantage (per token, from a critic, not per group) and an extra model; the
loss, the loop (`loop.fit`) and the rollout batch are the same. Groups of `samples_per_prompt` still work (the
critic does not need them: 1 is plain PPO). `advantage_estimator` is not read: GAE replaces it.
`offload_during_rollout` moves the policy's training state only; the critic's stays on the device.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

from ..train import chat
from ..fieldtypes import COUNT, check_fields, checked_args, number_in, optional
from . import advantages, core, critic, grpo, loop
from .rollout import RolloutBackend


@dataclass(kw_only=True)
class PPOConfig(core.RolloutConfig):
    """Knobs of one PPO run: the shared ones (`core.RolloutConfig`; the critic takes the same `ppo_epochs`,
    `num_minibatches`, `micro_batch_size` and packing as the policy), the clipped loss's, and GAE's."""

    clip_eps: float = 0.2
    """Ratio clip of the policy loss: [1 - clip_eps, 1 + clip_eps]."""
    loss_level: core.LossLevel = "token"
    """Policy loss reduction (`core.aggregate`): "token" (per-token mean) or "sequence" (mean of sequence means)."""
    gamma: float = 1.0
    """Discount per completion token. 1.0 (verl's default for LLMs): the outcome reward counts fully at every token."""
    lam: float = 0.95
    """GAE's lambda: 1 = Monte-Carlo returns minus values (no bias from the critic, most variance), 0 = one-step TD."""
    value_clip: float | None = 0.5
    """PPO's value clip: the critic's new values count in the loss only within +-value_clip of the values the
    advantages came from (`critic.value_loss`; verl's cliprange_value 0.5). None: no clip."""
    whiten_advantages: bool = True
    """Normalise the GAE advantages to mean 0, std 1 over the iteration's completion tokens (`advantages.whiten`)."""

    def __post_init__(self):
        super().__post_init__()
        check_fields(self, gamma=number_in(0, 1), lam=number_in(0, 1), clip_eps=number_in(0, low_open=True),
                     value_clip=optional(number_in(0, low_open=True)))


@dataclass
class PPOHistory(grpo.GRPOHistory):
    """GRPO's per-iteration metrics plus the critic's."""

    value_loss: list[float] = field(default_factory=list)
    """The clipped value loss, mean over the iteration's critic steps."""
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


def iteration(*, chunks, optimizer, critic_chunks, critic_optimizer, bridge, rollout: RolloutBackend,
              prompts: list[tuple[str, str]], reward_fn, pcfg: PPOConfig, seq_len_tokens: int, ref_chunks=None,
              index: int = 0, scheduler=None, critic_scheduler=None) -> dict:
    """One PPO iteration over `prompts` (same list on every rank): the module docstring's five steps. The policy
    (`chunks`, `optimizer`) and the critic (`critic_chunks` from `critic.value_model`, `critic_optimizer`) are
    separate models with separate optimizers; `scheduler` / `critic_scheduler` step once per optimizer step each."""
    rollouts = core.collect(chunks=chunks, bridge=bridge, backend=rollout, prompts=prompts,
                            reward=core.as_reward(reward_fn), samples_per_prompt=pcfg.samples_per_prompt,
                            max_new_tokens=pcfg.max_new_tokens, temperature=pcfg.temperature, top_p=pcfg.top_p,
                            seed=core.rollout_seed(seed=pcfg.seed, iteration=index),
                            offload_optimizer=optimizer if pcfg.offload_during_rollout else None)
    pad_id = chat.pad_id(rollout.tokenizer)
    t0 = time.perf_counter()
    batch = critic.value_batch(rollouts, seq_len_tokens=seq_len_tokens, pad_id=pad_id)
    v = critic.values(critic_chunks, batch, micro_batch_size=pcfg.micro_batch_size, packed=pcfg.packed)
    adv, returns = advantages.gae(advantages.outcome_rewards(rollouts.rewards, batch.loss_mask), v, batch.loss_mask,
                                  gamma=pcfg.gamma, lam=pcfg.lam)
    batch.extras.update(values=v, returns=returns)
    on = batch.loss_mask != 0
    stats = dict(explained_variance=critic.explained_variance(v, returns, batch.loss_mask),
                 value_mean=v[on].mean().item(), advantage_abs_mean=adv[on].abs().mean().item())
    values_s = time.perf_counter() - t0
    used = advantages.whiten(adv, batch.loss_mask) if pcfg.whiten_advantages else adv
    loss_fn = partial(grpo.grpo_loss, clip_eps=pcfg.clip_eps, kl_coef=pcfg.kl_coef, level=pcfg.loss_level)
    policy = loop.policy_update(rollouts, chunks=chunks, optimizer=optimizer, cfg=pcfg, loss_fn=loss_fn,
                                seq_len_tokens=seq_len_tokens, pad_id=pad_id, ref_chunks=ref_chunks,
                                scheduler=scheduler, precomputed_advantages=used)
    value = critic.update(chunks=critic_chunks, optimizer=critic_optimizer, batch=batch, value_clip=pcfg.value_clip,
                          epochs=pcfg.ppo_epochs, num_minibatches=pcfg.num_minibatches,
                          micro_batch_size=pcfg.micro_batch_size, scheduler=critic_scheduler, packed=pcfg.packed,
                          max_tokens_per_micro_batch=pcfg.max_tokens_per_micro_batch)
    return dict(**rollouts.stats, **core.rollout_metrics(rollouts), **policy, **stats,
                value_loss=value["value_loss"], value_clip_frac=value["value_clip_frac"],
                critic_s=values_s + value["critic_update_s"])


@checked_args(iterations=COUNT, seq_len_tokens=optional(COUNT))
def fit(*, chunks, optimizer, critic_chunks, critic_optimizer, bridge, rollout: RolloutBackend,
        prompt_pool: list[tuple[str, str]], reward_fn, pcfg: PPOConfig, iterations: int,
        seq_len_tokens: int | None = None, ref_chunks=None, progress: bool = True, on_iteration=None, scheduler=None,
        critic_scheduler=None) -> PPOHistory:
    """`iterations` PPO iterations through the generic `loop.fit` (prompts drawn from `prompt_pool` by
    `core.PromptDraw`, seeded by `pcfg.seed`); `on_iteration`, `scheduler` and `seq_len_tokens` as in `grpo.fit`."""
    def one(*, index: int, draw, seq_len_tokens: int) -> dict:
        return iteration(chunks=chunks, optimizer=optimizer, critic_chunks=critic_chunks,
                         critic_optimizer=critic_optimizer, bridge=bridge, rollout=rollout,
                         prompts=draw(pcfg.prompts_per_iteration), reward_fn=reward_fn, pcfg=pcfg,
                         seq_len_tokens=seq_len_tokens, ref_chunks=ref_chunks, index=index, scheduler=scheduler,
                         critic_scheduler=critic_scheduler)
    return loop.fit(iteration=one, cfg=pcfg, prompt_pool=prompt_pool, tokenizer=rollout.tokenizer,
                    iterations=iterations, seq_len_tokens=seq_len_tokens, history=PPOHistory(), desc="ppo",
                    progress=progress, on_iteration=on_iteration)
