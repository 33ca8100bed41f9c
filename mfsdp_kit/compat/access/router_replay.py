"""megatron's MoE router replay, reached here and nowhere else (`models.router_replay` is its user).

megatron-core 0.16.1 builds a `RouterReplay` (transformer/moe/router_replay.py) on every `TopKRouter` whose config
sets `moe_enable_routing_replay` (router.py:205-207), and its routing calls `router_replay.get_replay_topk`
(moe_utils.py:700-706) in place of its own top-k. With the action REPLAY_FORWARD that returns the target indices and
the router's own scores gathered at them (router_replay.py `get_replay_topk`): the choice is replayed, the combine
weights and their gradient stay the router's. RECORD keeps the indices its own top-k chose. No patch: upstream API
the kit calls; the registry row's canary fails when upstream stops routing through it (tests/compat/
test_router_replay.py).
"""
from __future__ import annotations

import torch

from ..registry import Patch, record


def routing_still_replayable() -> bool:
    """True while megatron's top-k routing hands its choice to the router's RouterReplay and a replayed forward
    gathers the router's own scores at the replayed experts."""
    from ..registry import upstream_source
    routing = upstream_source("megatron.core.transformer.moe.moe_utils:topk_routing_with_score_function")
    replay = upstream_source("megatron.core.transformer.moe.router_replay:RouterReplay.get_replay_topk")
    return "router_replay.get_replay_topk(" in routing and "probs = scores.gather(1, top_indices)" in replay


ROW = Patch(target="megatron.core.transformer.moe.router_replay:RouterReplay.get_replay_topk",
            upstream="megatron/core/transformer/moe/router.py:205-207 (a RouterReplay per TopKRouter under "
                     "moe_enable_routing_replay), moe_utils.py:700-706 (top-k through it), router_replay.py "
                     "get_replay_topk (REPLAY_FORWARD: the target indices, scores gathered at them); no patch: an "
                     "upstream API the kit depends on",
            needed_if=routing_still_replayable)
"""The registry row of the dependency, recorded when a model's routers are first reached."""


def routers(chunks: list[torch.nn.Module]) -> list:
    """Every TopKRouter of `chunks`, in module order."""
    from megatron.core.transformer.moe.router import TopKRouter
    found = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
    if found:
        record(ROW)
    return found


def replay_of(router):
    """The router's RouterReplay, or None where it was built without `moe_enable_routing_replay`."""
    return router.router_replay


def moe_layer_numbers(config) -> list[int]:
    """The 1-based global layer numbers of a TransformerConfig's MoE layers, by megatron's rule for
    `moe_layer_freq` (gpt_layer_specs.py:579-596: an int n, every n-th layer from the first; a list, 1 per MoE
    layer)."""
    if not getattr(config, "num_moe_experts", None):
        return []
    freq = config.moe_layer_freq
    pattern = [int(i % freq == 0) for i in range(config.num_layers)] if isinstance(freq, int) else list(freq)
    return [i + 1 for i, moe in enumerate(pattern) if moe]


def replay(router, indices: torch.Tensor) -> None:
    """Route `router`'s next forward (and a recompute in its backward) by `indices` [tokens, k], megatron's token
    order."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    r = router.router_replay
    r.clear_indices()
    r.set_target_indices(indices)
    r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def start_recording(router) -> None:
    """Keep the indices the router's own top-k chooses from now on (the last forward's)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    router.router_replay.clear_indices()
    router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)


def recorded(router) -> torch.Tensor | None:
    """[tokens, k] of the last recorded forward, or None."""
    return router.router_replay.get_recorded_indices()


def stop(router, *, drop: bool) -> None:
    """Back to the router's own top-k; `drop`: forget the indices held too."""
    router.router_replay.clear_router_replay_action()
    if drop:
        router.router_replay.clear_indices()
