"""GRPO in the notebooks' spelling: `grpo.fit` / `grpo.iteration` take the policy's parts as keywords and run the
one loop (`rl.loop.fit` / `rl.loop.iteration`, with `loop.Models`). The algorithm itself, its config, loss and
advantages, is `rl/algorithms/grpo.py`; its names are served here too.

`fit` runs whatever algorithm its `cfg` registers (GRPO, DAPO, RLOO, REINFORCE++); PPO's critic goes through
`ppo.fit` or `loop.Models(critic=...)`. The old keyword `gcfg=` and `GRPOHistory` still work and warn once.
"""
from __future__ import annotations

from . import loop
from .algorithms.grpo import GRPO, GRPOConfig, clipped_loss, grpo_loss, policy_loss  # noqa: F401 (public names)
from .core import ADV_EPS, Reward, group_advantages, rollout_batch, token_logprobs  # noqa: F401 (public names)
from .loop import History, Models
from .renamed import aliases, renamed
from .rollout import RolloutBackend, default_backend

Rollout = default_backend
"""The rollout backend for an HF model and its tokenizer: the kit's engine where it runs (`rollout.default_backend`)."""
__getattr__ = aliases(__name__, {"GRPOHistory": (History, "mfsdp_kit.rl.loop.History")})


@renamed("grpo.iteration", gcfg="cfg")
def iteration(*, chunks, optimizer, bridge, rollout: RolloutBackend, prompts: list[tuple[str, str]], reward_fn,
              cfg: GRPOConfig, seq_len_tokens: int, ref_chunks=None, index: int = 0, scheduler=None) -> dict:
    """`loop.iteration` over `prompts` [(prompt, answer)] (the same list on every rank); `reward_fn` is a callable
    or a `core.Reward`; `scheduler` (e.g. `engine.build_scheduler`, for a warm-up) steps once per optimizer step."""
    models = Models(chunks=chunks, optimizer=optimizer, bridge=bridge, rollout=rollout, ref_chunks=ref_chunks,
                    scheduler=scheduler)
    return loop.iteration(models=models, cfg=cfg, draw=lambda _k: prompts, reward_fn=reward_fn,
                          seq_len_tokens=seq_len_tokens, index=index)


@renamed("grpo.fit", gcfg="cfg")
def fit(*, chunks, optimizer, bridge, rollout: RolloutBackend, prompt_pool: list[tuple[str, str]], reward_fn,
        cfg: GRPOConfig, iterations: int, seq_len_tokens: int | None = None, ref_chunks=None,
        progress: bool = True, on_iteration=None, scheduler=None) -> History:
    """`loop.fit`: `iterations` iterations, each on `prompts_per_iteration` prompts drawn from `prompt_pool`
    (seeded by `cfg.seed`); `seq_len_tokens`, `on_iteration` and the warm-up `scheduler` as there."""
    models = Models(chunks=chunks, optimizer=optimizer, bridge=bridge, rollout=rollout, ref_chunks=ref_chunks,
                    scheduler=scheduler)
    return loop.fit(models=models, cfg=cfg, prompt_pool=prompt_pool, reward_fn=reward_fn, iterations=iterations,
                    seq_len_tokens=seq_len_tokens, progress=progress, on_iteration=on_iteration)
