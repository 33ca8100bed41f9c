"""DAPO in the notebooks' spelling: `dapo.fit` / `dapo.iteration` run the one loop (`rl.loop`) on a `DAPOConfig`.
The algorithm itself, its config, filter and loss, is `rl/algorithms/dapo.py`; its names are served here too.
The old keyword `dcfg=` and `DAPOHistory` still work and warn once.
"""
from __future__ import annotations

from typing import Callable

from . import grpo, loop
from .algorithms.dapo import (DAPO, DAPOConfig, clip_higher_loss, dapo_loss, dynamic_sample,  # noqa: F401
                              dynamic_sampling, informative_groups, prompts_to_draw, usable_groups)
from .loop import History, Models
from .renamed import aliases, renamed
from .rollout import RolloutBackend

__getattr__ = aliases(__name__, {"DAPOHistory": (History, "mfsdp_kit.rl.loop.History")})

fit = renamed("dapo.fit", dcfg="cfg")(grpo.fit)
"""`grpo.fit` (`loop.fit` with the policy's parts as keywords), given a `DAPOConfig`."""


@renamed("dapo.iteration", dcfg="cfg")
def iteration(*, chunks, optimizer, bridge, rollout: RolloutBackend, draw_prompts: Callable[[int], list], reward_fn,
              cfg: DAPOConfig, seq_len_tokens: int, ref_chunks=None, index: int = 0, scheduler=None) -> dict:
    """`loop.iteration` of DAPO: dynamic sampling from `draw_prompts(k)` (the same on every rank), then the update."""
    models = Models(chunks=chunks, optimizer=optimizer, bridge=bridge, rollout=rollout, ref_chunks=ref_chunks,
                    scheduler=scheduler)
    return loop.iteration(models=models, cfg=cfg, draw=draw_prompts, reward_fn=reward_fn,
                          seq_len_tokens=seq_len_tokens, index=index)
