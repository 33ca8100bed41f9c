"""PPO in the notebooks' spelling: `ppo.fit` / `ppo.iteration` take the policy's and the critic's parts as keywords
and run the one loop (`rl.loop`, the critic as `loop.Models.critic`). The algorithm itself, its config and its
GAE-with-critic estimator, is `rl/algorithms/ppo.py`; the value model is `rl.critic`. The old keyword `pcfg=` and
`PPOHistory` still work and warn once.
"""
from __future__ import annotations

from . import loop
from .algorithms.ppo import PPO, PPOConfig, gae_with_critic  # noqa: F401 (public names)
from .critic import Critic
from .loop import History, Models
from .renamed import aliases, renamed
from .rollout import RolloutBackend

__getattr__ = aliases(__name__, {"PPOHistory": (History, "mfsdp_kit.rl.loop.History")})


def models(*, chunks, optimizer, critic_chunks, critic_optimizer, bridge, rollout: RolloutBackend, ref_chunks=None,
           scheduler=None, critic_scheduler=None) -> Models:
    """`loop.Models` with a `critic.Critic` of `critic_chunks` (`critic.value_model`) and its own optimizer."""
    return Models(chunks=chunks, optimizer=optimizer, bridge=bridge, rollout=rollout, ref_chunks=ref_chunks,
                  scheduler=scheduler, critic=Critic(chunks=critic_chunks, optimizer=critic_optimizer,
                                                     scheduler=critic_scheduler))


@renamed("ppo.iteration", pcfg="cfg")
def iteration(*, chunks, optimizer, critic_chunks, critic_optimizer, bridge, rollout: RolloutBackend,
              prompts: list[tuple[str, str]], reward_fn, cfg: PPOConfig, seq_len_tokens: int, ref_chunks=None,
              index: int = 0, scheduler=None, critic_scheduler=None) -> dict:
    """`loop.iteration` of PPO over `prompts` (the same list on every rank): the policy (`chunks`, `optimizer`) and
    the critic (`critic_chunks`, `critic_optimizer`) with separate optimizers; each scheduler steps once per step
    of its optimizer."""
    return loop.iteration(models=models(chunks=chunks, optimizer=optimizer, critic_chunks=critic_chunks,
                                        critic_optimizer=critic_optimizer, bridge=bridge, rollout=rollout,
                                        ref_chunks=ref_chunks, scheduler=scheduler, critic_scheduler=critic_scheduler),
                          cfg=cfg, draw=lambda _k: prompts, reward_fn=reward_fn, seq_len_tokens=seq_len_tokens,
                          index=index)


@renamed("ppo.fit", pcfg="cfg")
def fit(*, chunks, optimizer, critic_chunks, critic_optimizer, bridge, rollout: RolloutBackend,
        prompt_pool: list[tuple[str, str]], reward_fn, cfg: PPOConfig, iterations: int,
        seq_len_tokens: int | None = None, ref_chunks=None, progress: bool = True, on_iteration=None, scheduler=None,
        critic_scheduler=None) -> History:
    """`loop.fit` of PPO (prompts drawn from `prompt_pool`, seeded by `cfg.seed`); `seq_len_tokens`, `on_iteration`
    and the schedulers as in `grpo.fit`."""
    return loop.fit(models=models(chunks=chunks, optimizer=optimizer, critic_chunks=critic_chunks,
                                  critic_optimizer=critic_optimizer, bridge=bridge, rollout=rollout,
                                  ref_chunks=ref_chunks, scheduler=scheduler, critic_scheduler=critic_scheduler),
                    cfg=cfg, prompt_pool=prompt_pool, reward_fn=reward_fn, iterations=iterations,
                    seq_len_tokens=seq_len_tokens, progress=progress, on_iteration=on_iteration)
