"""GRPO at notebook scale: rollouts from synced FSDP weights, verifiable rewards, policy update.

One iteration, each step a function of `rl.core` called in the open by `iteration`:
  1. collect   sync every chunk's weights into the rollout backend (`rollout.HFRollout.refresh`),
               each data-parallel rank samples n completions for its share of the prompts, the
               reward scores them (`reward_fn(prompt, completion) -> float`; default: exact match)
  2. advantage per prompt group: A = (r - mean(r)) / (std(r) + eps), eps = 1e-6 so a group
               whose samples all scored alike gets A = 0 instead of a division by zero
  3. log-probs of the sampled tokens recomputed by the Megatron model (`old`, before the update)
               and by a frozen reference model (optional)
  4. update    `ppo_epochs` passes over `num_minibatches` mini-batches with `grpo_loss`.

The loss per completion token t of sequence i, with ratio rho = exp(log p_theta - log p_old):

    l_it = -min(rho * A_i, clip(rho, 1 - eps, 1 + eps) * A_i) + kl_coef * k3_it
    k3_it = exp(d) - d - 1,  d = log p_ref - log p_theta     (>= 0, unbiased for KL(pi || ref))

averaged over all completion tokens of the minibatch (`loss_level="token"`, as the kit's GRPO
always did through megatron's per-token loss), or per sequence first (`"sequence"`, the paper's
(1/G) sum_i (1/|o_i|) sum_t l_it); `rl.core.aggregate` writes both out.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from ..train import chat
from . import core, loop
from .core import ADV_EPS, Reward, group_advantages, rollout_batch, token_logprobs  # noqa: F401 (public names)
from .rollout import RolloutBackend, default_backend
from ..fieldtypes import COUNT, checked_args, optional
from ..train import Batch

Rollout = default_backend
"""The rollout backend for an HF model and its tokenizer: the kit's engine where it runs (`rollout.default_backend`)."""


@dataclass(kw_only=True)
class GRPOConfig(core.RolloutConfig):
    """Knobs of one GRPO run: the shared ones (`core.RolloutConfig`) and the clipped loss's."""

    clip_eps: float = 0.2
    """Ratio clip: the loss stops pushing once ratio leaves [1 - clip_eps, 1 + clip_eps]."""
    min_advantage: float | None = None
    """Advantages below this are raised to it (None = plain GRPO). 0.0 keeps only the better-than-
    group-mean samples: they are pushed up, the worse ones are left alone instead of pushed down."""
    loss_level: core.LossLevel = "token"
    """"token": mean over all completion tokens of a minibatch; "sequence": mean of per-sequence
    means (the GRPO paper). See `rl.core.aggregate`."""


def policy_loss(mb: Batch, token_losses: torch.Tensor, *, eps_low: float, eps_high: float, kl_coef: float,
                level: core.LossLevel = "token"):
    """megatron loss_func of the clipped-ratio objective (module docstring) with the clip range
    [1 - eps_low, 1 + eps_high]; token_losses = -log p_theta(sampled token). Logs kl, clip_frac
    and the sampled-token entropy estimate as per-token means."""
    mask = mb.loss_mask.float()
    logp = -token_losses.float()
    ratio = torch.exp(logp - mb.extras["old_logprobs"])
    adv = mb.extras["advantages"] if mb.extras["advantages"].dim() == 2 else mb.extras["advantages"].unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if "is_weights" in mb.extras:   # rollout correction (rl.correction): pi_old / q, truncated or masked
        per_token = per_token * mb.extras["is_weights"]
    delta = mb.extras["ref_logprobs"] - logp
    kl = torch.exp(delta) - delta - 1  # k3 estimator: >= 0, unbiased for KL(pi || ref)
    if kl_coef:
        per_token = per_token + kl_coef * kl
    loss_sum, count = core.aggregate(per_token, mask, level=level)
    tokens = mask.sum()
    clip_frac = ((ratio - clipped).abs() > 0).float()
    logged = {"lm loss": torch.stack([loss_sum.detach(), count]),
              "kl": torch.stack([(kl.detach() * mask).sum(), tokens]),
              "clip_frac": torch.stack([(clip_frac * mask).sum(), tokens]),
              "entropy": torch.stack([(-logp.detach() * mask).sum(), tokens])}  # sampled-token estimate
    return loss_sum, count.to(torch.int), logged


def grpo_loss(mb: Batch, token_losses: torch.Tensor, *, clip_eps: float, kl_coef: float,
              level: core.LossLevel = "token"):
    """megatron loss_func for GRPO: `policy_loss` with the symmetric clip [1 - clip_eps, 1 + clip_eps]."""
    return policy_loss(mb, token_losses, eps_low=clip_eps, eps_high=clip_eps, kl_coef=kl_coef, level=level)


@dataclass
class GRPOHistory:
    """Per-iteration metrics."""

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


def iteration(*, chunks, optimizer, bridge, rollout: RolloutBackend, prompts: list[tuple[str, str]], reward_fn,
              gcfg: GRPOConfig, seq_len_tokens: int, ref_chunks=None, index: int = 0, scheduler=None) -> dict:
    """One GRPO iteration over `prompts` [(prompt, answer)] (same list on every rank); `reward_fn`
    is a callable or a `core.Reward` (which says what counts as solved: `accuracy`); `scheduler`
    (e.g. `engine.build_scheduler`, for a warm-up) steps once per optimizer step."""
    rollouts = core.collect(chunks=chunks, bridge=bridge, backend=rollout, prompts=prompts,
                            reward=core.as_reward(reward_fn), samples_per_prompt=gcfg.samples_per_prompt,
                            max_new_tokens=gcfg.max_new_tokens, temperature=gcfg.temperature, top_p=gcfg.top_p,
                            seed=core.rollout_seed(seed=gcfg.seed, iteration=index),
                            offload_optimizer=optimizer if gcfg.offload_during_rollout else None)
    loss_fn = partial(grpo_loss, clip_eps=gcfg.clip_eps, kl_coef=gcfg.kl_coef, level=gcfg.loss_level)
    return dict(**rollouts.stats, **core.rollout_metrics(rollouts),
                **loop.policy_update(rollouts, chunks=chunks, optimizer=optimizer, cfg=gcfg, loss_fn=loss_fn,
                                     seq_len_tokens=seq_len_tokens, pad_id=chat.pad_id(rollout.tokenizer),
                                     ref_chunks=ref_chunks, scheduler=scheduler, min_advantage=gcfg.min_advantage))


@checked_args(iterations=COUNT, seq_len_tokens=optional(COUNT))
def fit(*, chunks, optimizer, bridge, rollout: RolloutBackend, prompt_pool: list[tuple[str, str]], reward_fn,
        gcfg: GRPOConfig, iterations: int, seq_len_tokens: int | None = None, ref_chunks=None,
        progress: bool = True, on_iteration=None, scheduler=None) -> GRPOHistory:
    """`iterations` GRPO iterations, each on `prompts_per_iteration` prompts drawn deterministically
    from `prompt_pool` (`core.PromptDraw`, seeded by `gcfg.seed`).

    `on_iteration(iteration, metrics)` runs on every rank after each iteration (e.g. a held-out
    evaluation every k iterations; it may run collectives, as all ranks call it). A fresh Adam
    without warm-up takes sign-like steps of the full lr at first, which on CPU at lr 3e-5 cost a
    small SFT'd model ~5 held-out points in 15 steps even on gold SFT data: pass a `scheduler`
    with a warm-up. `seq_len_tokens` (the training sequences' length): None = what the longest prompt of the
    pool plus `max_new_tokens` needs (`core.seq_len_needed`); a shorter value is refused before any rollout."""
    def one(*, index: int, draw, seq_len_tokens: int) -> dict:
        return iteration(chunks=chunks, optimizer=optimizer, bridge=bridge, rollout=rollout,
                         prompts=draw(gcfg.prompts_per_iteration), reward_fn=reward_fn, gcfg=gcfg,
                         seq_len_tokens=seq_len_tokens, ref_chunks=ref_chunks, index=index, scheduler=scheduler)
    return loop.fit(iteration=one, cfg=gcfg, prompt_pool=prompt_pool, tokenizer=rollout.tokenizer,
                    iterations=iterations, seq_len_tokens=seq_len_tokens, history=GRPOHistory(), desc="grpo",
                    progress=progress, on_iteration=on_iteration)
