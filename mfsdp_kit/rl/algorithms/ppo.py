"""PPO with a learned critic: GRPO's loss on per-token advantages from GAE over a value model that trains beside it.

Its advantage estimator (`gae_with_critic`), the only piece it changes:
  1. values    the critic's V [n, seq] at the completion tokens, no grad (`critic.values`)
  2. GAE       the outcome reward on each completion's last token (`advantages.outcome_rewards`), then
               A_t = delta_t + gamma * lam * A_{t+1}, delta_t = r_t + gamma * V_{t+1} - V_t, returns R = A + V
               (`advantages.gae`), A whitened over the batch's completion tokens (`whiten_advantages`)
  3. critic    after the policy's update (`clipped_loss` on [n, seq] advantages, as GRPO's), the same number of
               steps of the clipped value loss on (V_old, R) with its own optimizer (`critic.update`)

The critic is `Models.critic` (`critic.Critic`: `critic.value_model` and its optimizer). Groups of
`samples_per_prompt` still work (1 is plain PPO); `advantage_estimator` is not read: GAE replaces it.
`offload_during_rollout` moves the policy's training state only; the critic's stays on the device.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ...fieldtypes import check_fields, number_in, optional
from .. import advantages, core, critic
from .grpo import clipped_loss
from .registration import Algorithm, Estimate, register


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


def gae_with_critic(kept: core.RolloutBatch, cfg: PPOConfig, *, models, seq_len_tokens: int, pad_id: int) -> Estimate:
    """The module docstring's steps 1-2 now, step 3 as the estimate's `after_update`. Reports explained_variance,
    value_mean, advantage_abs_mean; then value_loss, value_clip_frac and critic_s (values and update)."""
    if models.critic is None:
        raise ValueError("PPO needs a value model: Models(critic=critic.Critic(chunks=critic.value_model(...), "
                         "optimizer=...))")
    value_model = models.critic
    t0 = time.perf_counter()
    batch = critic.value_batch(kept, seq_len_tokens=seq_len_tokens, pad_id=pad_id)
    v = critic.values(value_model.chunks, batch, options=cfg.scoring_options())
    adv, returns = advantages.gae(advantages.outcome_rewards(kept.rewards, batch.loss_mask), v, batch.loss_mask,
                                  gamma=cfg.gamma, lam=cfg.lam)
    batch.extras.update(values=v, returns=returns)
    on = batch.loss_mask != 0
    stats = dict(explained_variance=critic.explained_variance(v, returns, batch.loss_mask),
                 value_mean=v[on].mean().item(), advantage_abs_mean=adv[on].abs().mean().item())
    values_s = time.perf_counter() - t0

    def train_critic() -> dict:
        value = critic.update(chunks=value_model.chunks, optimizer=value_model.optimizer, batch=batch,
                              value_clip=cfg.value_clip, epochs=cfg.ppo_epochs, num_minibatches=cfg.num_minibatches,
                              options=cfg.step_options(scheduler=value_model.scheduler))
        return dict(value_loss=value["value_loss"], value_clip_frac=value["value_clip_frac"],
                    critic_s=values_s + value["critic_update_s"])
    used = advantages.whiten(adv, batch.loss_mask) if cfg.whiten_advantages else adv
    return Estimate(advantages=used, metrics=stats, after_update=train_critic)


PPO = register(Algorithm(name="ppo", config=PPOConfig, loss=clipped_loss, advantages=gae_with_critic))
