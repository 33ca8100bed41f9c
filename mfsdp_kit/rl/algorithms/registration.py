"""What an RL algorithm is here: a registration of its config, its loss and, where it has them, its sampling filter
and its advantage estimator. The one loop (`rl.loop.iteration`, `rl.loop.fit`) finds the registration of the config
it is given (`of`) and calls its pieces in the open:

    sample      the iteration's rollouts and the groups that train (`Sampled`); default `sample_once`: one
                `collect_round` of `prompts_per_iteration` prompts, every group kept (DAPO: dynamic sampling)
    advantages  kept rollouts -> advantages (`Estimate`); default `critic_free`: the estimator the config names
                (`advantage_estimator`: group baseline, leave-one-out, batch-whitened; PPO: GAE with its critic)
    loss        cfg -> the megatron loss_func of the policy update (`core.aggregate`'s contract)

torchtitan writes a loss as a class with a nested Config and shares the trainer; here the record is plain functions,
so an algorithm reads top to bottom in one file of `rl/algorithms/`, and its config's fields (each with its
docstring) are its bench and CLI options (`perf.options`). A config class of yours that subclasses a registered one
is that algorithm; a new one is `register(Algorithm(...))` beside its config.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ...config import ConfigError
from .. import advantages, core
from ..core import Reward, RolloutBatch, RolloutConfig
from ..critic import Critic
from ..rollout import RolloutBackend


@dataclass(kw_only=True)
class Models:
    """What an RL run trains and samples with, the same every iteration."""

    chunks: list
    """The policy's model chunks (`models.hf.load(...).chunks`, `engine.build`)."""
    optimizer: Any
    """The policy's optimizer (`engine.build_optimizer`)."""
    bridge: Any
    """The Megatron-Bridge the rollout backend's weights are synced through (`RolloutBackend.refresh`)."""
    rollout: RolloutBackend
    """What samples the completions (`rl.rollout.default_backend`, `HFRollout`, `ContinuousRollout`)."""
    ref_chunks: list | None = None
    """A frozen reference model for the KL term (`kl_coef`); None: the KL is to pi_old, 0 at the first step."""
    scheduler: Any = None
    """Steps once per policy optimizer step (e.g. `engine.build_scheduler`, for a warm-up)."""
    critic: Critic | None = None
    """A value model and its optimizer, for the estimators that read one (PPO's GAE)."""


@dataclass
class Sampled:
    """An iteration's rollouts: everything sampled (the iteration's reward and accuracy) and the groups that train."""

    everything: RolloutBatch
    kept: RolloutBatch
    """Groups of `everything`; none: the iteration makes no update (`loop.NO_UPDATE`)."""
    metrics: dict = field(default_factory=dict)
    """What the filter reports (DAPO: groups_sampled, groups_kept, sampling_rounds)."""


@dataclass
class Estimate:
    """An estimator's answer for the kept rollouts."""

    advantages: torch.Tensor
    """[n] per completion, or [n, seq] per token in the training batch's layout (`core.rollout_batch`)."""
    metrics: dict = field(default_factory=dict)
    after_update: Callable[[], dict] | None = None
    """Runs after the policy's update and returns its metrics (PPO: the critic's own update)."""


def collect_round(models: Models, cfg: RolloutConfig, *, prompts: list[tuple[str, str]], reward: Reward, index: int,
                  round: int = 0) -> RolloutBatch:
    """`core.collect` of `prompts` as `cfg` samples, seeded by iteration `index` and `round`
    (`core.rollout_seed`); the weights are synced on round 0 only."""
    return core.collect(chunks=models.chunks, bridge=models.bridge, backend=models.rollout, prompts=prompts,
                        reward=reward, samples_per_prompt=cfg.samples_per_prompt, max_new_tokens=cfg.max_new_tokens,
                        temperature=cfg.temperature, top_p=cfg.top_p,
                        seed=core.rollout_seed(seed=cfg.seed, iteration=index, round=round), refresh=round == 0,
                        offload_optimizer=models.optimizer if cfg.offload_during_rollout else None,
                        routes=cfg.router_replay)


def sample_once(models: Models, cfg: RolloutConfig, *, draw: Callable[[int], list], reward: Reward,
                index: int) -> Sampled:
    """One round of `draw(prompts_per_iteration)` prompts; every group trains."""
    batch = collect_round(models, cfg, prompts=draw(cfg.prompts_per_iteration), reward=reward, index=index)
    return Sampled(everything=batch, kept=batch)


def critic_free(kept: RolloutBatch, cfg: RolloutConfig, **context) -> Estimate:
    """The advantages of `cfg.advantage_estimator` from the outcome rewards alone (`advantages.estimate`); the
    loop's `context` (models, seq_len_tokens, pad_id) is not read."""
    return Estimate(advantages=advantages.estimate(kept.rewards, group_size=cfg.samples_per_prompt,
                                                   estimator=cfg.advantage_estimator))


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    """One RL algorithm: the pieces `loop.iteration` calls (module docstring)."""

    name: str
    """The registry's key and the progress bar's label ("grpo")."""
    config: type
    """Its config class, a `core.RolloutConfig`: `of(cfg)` finds the registration by it."""
    loss: Callable[[Any], Callable]
    """cfg -> the megatron loss_func of the policy update: (mb, token_losses) -> (loss sum, count, logged)."""
    sample: Callable[..., Sampled] = sample_once
    """(models, cfg, *, draw, reward, index) -> `Sampled`: the filter, where it has one."""
    advantages: Callable[..., Estimate] = critic_free
    """(kept, cfg, *, models, seq_len_tokens, pad_id) -> `Estimate`: the advantage estimator."""


REGISTRY: dict[str, Algorithm] = {}
"""name -> registration: every algorithm whose module was imported (`rl.algorithms` imports the kit's own)."""


def register(algorithm: Algorithm) -> Algorithm:
    """Add `algorithm` and return it (`GRPO = register(Algorithm(...))`). A name taken by another config class is
    refused; the same one again (its module reloaded) replaces it."""
    old = REGISTRY.get(algorithm.name)
    if old is not None and (old.config.__module__, old.config.__qualname__) != (algorithm.config.__module__,
                                                                                algorithm.config.__qualname__):
        raise ValueError(f"algorithm {algorithm.name!r} is registered already, for {old.config.__qualname__}")
    REGISTRY[algorithm.name] = algorithm
    return algorithm


def of(cfg: RolloutConfig) -> Algorithm:
    """The registration of `cfg`'s class, or of its nearest registered base class."""
    for klass in type(cfg).__mro__:
        for algorithm in REGISTRY.values():
            if algorithm.config is klass:
                return algorithm
    known = ", ".join(a.config.__qualname__ for a in REGISTRY.values())
    raise ConfigError(f"cfg={type(cfg).__qualname__}(...) is not allowed; allowed: the config of a registered "
                      f"algorithm ({known})")
