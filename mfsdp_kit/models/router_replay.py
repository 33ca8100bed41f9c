"""MoE router replay: the experts another forward chose (the rollout engine's), replayed in the trainer's.

An MoE policy's train-rollout log-prob mismatch has two sources: the numerics of two forwards over the same weights,
and routing flips. A token whose router scores sit near the k-th boundary picks another expert in the trainer than
it did in the rollout, and its log-prob jumps by far more than the numerics alone would move it. Replay removes the
flips: megatron's own router replay (`compat.access.router_replay`; `moe_enable_routing_replay`, which the kit sets
for every MoE model in `transformer_settings.engine_settings`) takes per-layer top-k indices, and the router gathers
its OWN scores at those experts. The combine weights stay the trainer's (the router still gets its gradient, the
load-balancing loss still reads the router's scores); only the choice is the rollout's.

Routes travel per token as `[batch, seq, moe_layers, k]` int16 (an expert index; int16 holds 32767 experts) in the
batch's own layout, so they slice and pack like any per-token tensor. megatron's router sees a micro-batch's tokens
as `[seq * batch]`, seq-major (`TopKRouter.routing`: `logits.view(-1, experts)` of `[seq, batch, experts]`), so
`set_routes` and `Recording.routes` reorder them.

    with router_replay.recording(chunks) as rec:       # what this model chooses
        forward(...)
    routes = rec.routes(batch=b, seq=s)                # [b, s, moe_layers, k] int16
    router_replay.set_routes(chunks, routes)           # the next forward (and its backward) routes by them
    forward(...)
    router_replay.clear(chunks)

Replay follows one micro-batch through its forward and backward: megatron's no-pipelining schedule runs them back to
back, so even a full-recompute backward reads the same indices. Pipeline schedules run other micro-batches' forwards
in between, so pipeline parallelism is refused by name.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..compat.access import router_replay as upstream

ROUTE_DTYPE = torch.int16
"""The dtype routes travel in (expert indices < 32768)."""


@dataclass(frozen=True)
class Router:
    """One MoE layer's router on this rank and where its routes sit on the moe_layers axis."""

    module: torch.nn.Module
    """megatron's TopKRouter."""
    index: int
    """Its place among the whole model's MoE layers (the routes' third axis), 0-based."""
    layers: int
    """How many MoE layers the whole model has (the routes' third axis)."""
    topk: int
    """Experts per token."""


def routers(chunks: list[torch.nn.Module]) -> list[Router]:
    """This rank's MoE routers (every chunk, in order); ValueError naming the setting where they were built without
    replay."""
    out = []
    for module in upstream.routers(chunks):
        if upstream.replay_of(module) is None:
            raise ValueError("router replay: the model's MoE routers were built without moe_enable_routing_replay "
                             "(override_transformer_config turned it off?)")
        numbers = upstream.moe_layer_numbers(module.config)
        out.append(Router(module, numbers.index(module.layer_number), len(numbers), module.topk))
    return out


def _refuse_pipelines() -> None:
    from megatron.core import parallel_state as ps
    if ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError("router replay: pipeline_model_parallel_size must be 1 (a pipeline schedule runs other "
                         "micro-batches' forwards between one's forward and its backward)")


def set_routes(chunks: list[torch.nn.Module], routes: torch.Tensor) -> None:
    """Route the next forward of one micro-batch (`[batch, seq]` padded, `[1, tokens]` packed) by `routes`
    (`[batch, seq, moe_layers, k]`, any integer dtype), until `clear`. A dense model ignores them."""
    rs = routers(chunks)
    if not rs:
        return
    _refuse_pipelines()
    if routes.dim() != 4 or tuple(routes.shape[2:]) != (rs[0].layers, rs[0].topk):
        raise ValueError(f"routes: shape {tuple(routes.shape)}; expected [batch, seq, {rs[0].layers}, {rs[0].topk}] "
                         "([batch, seq, moe_layers, k])")
    tokens = routes.transpose(0, 1).long()                       # [seq, batch, layers, k]: megatron's token order
    for r in rs:
        upstream.replay(r.module, tokens[:, :, r.index].reshape(-1, r.topk))


def clear(chunks: list[torch.nn.Module]) -> None:
    """Back to the routers' own choice; the indices held are dropped."""
    for module in upstream.routers(chunks):
        if upstream.replay_of(module) is not None:
            upstream.stop(module, drop=True)


class Recording:
    """What the last forward under `recording` chose: `routes(batch=, seq=)`."""

    def __init__(self, rs: list[Router]):
        self._routers = rs

    def routes(self, *, batch: int, seq: int) -> torch.Tensor:
        """`[batch, seq, moe_layers, k]` int16 of the last forward over `[batch, seq]` tokens; the layers of other
        pipeline stages stay 0."""
        first = self._routers[0]
        out = None
        for r in self._routers:
            idx = upstream.recorded(r.module)
            if idx is None:
                raise RuntimeError("router replay: nothing recorded (no forward ran inside `recording`)")
            if out is None:
                out = torch.zeros(batch, seq, first.layers, first.topk, dtype=ROUTE_DTYPE, device=idx.device)
            out[:, :, r.index] = idx.view(seq, batch, r.topk).transpose(0, 1).to(ROUTE_DTYPE)
        return out


@contextmanager
def recording(chunks: list[torch.nn.Module]):
    """Record each MoE router's own top-k choice of the forwards inside (the last one's is kept)."""
    rs = routers(chunks)
    if not rs:
        raise ValueError("router replay: the model has no MoE layers")
    for r in rs:
        upstream.start_recording(r.module)
    try:
        yield Recording(rs)
    finally:
        for r in rs:
            upstream.stop(r.module, drop=False)


def flips(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """The fraction of (token, MoE layer) pairs whose expert SET differs between routes `a` and `b`
    (`[batch, seq, layers, k]`), over `mask` (`[batch, seq]`, 1 where counted; None: every token)."""
    same = (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)          # [batch, seq, layers]
    if mask is None:
        return 1.0 - same.float().mean().item()
    m = mask.bool().unsqueeze(-1).expand_as(same)
    return 1.0 - same[m].float().mean().item() if m.any() else 0.0
