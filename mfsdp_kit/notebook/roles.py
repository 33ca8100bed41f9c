"""Who each engine is: its rank, and with `cluster.start(n, rollout_engines=k)` its role.

Trainer engines (ranks 0 .. n-k-1) form the torch world, as every engine does without roles: megatron's groups,
Stop as a pause, the watchdog, the heartbeat; `%%px` and `handle.view` reach them. Rollout engines (the last k, in
the launcher's order) are outside that world: megatron builds its groups over the whole default world, so a
rollout process in it would become a data-parallel rank (docs/design.md, "Decoupled rollouts"). Each gets its GPU
(its local rank, as a trainer does), Stop (its own, no world to agree with) and a `weights.push.Link` to trainer
rank 0, over collectives (NCCL between GPUs, else gloo): in every engine's namespace `link` is that link on trainer
rank 0 and on each rollout engine (link rank 1 + its index), None on the other trainers, and `role` says which
it is. `handle.rollout_view` reaches the rollout engines; `rl.decoupled.serve` runs there while
`rl.decoupled.fit` runs on the trainers. A closed link (after Stop) is built again by `handle.relink()`.
"""
from __future__ import annotations

from typing import Any

from ..distributed import ports
from . import on_engine
from .launch import ClusterConfigError

LINK_WHAT = "connecting the rollout engines to trainer rank 0"
"""The step of forming the world that builds the link (named when it times out)."""


def assign_ranks(identities: dict[int, dict]) -> dict[int, tuple[int, int]]:
    """engine id -> (rank, local_rank): the launcher's ranks when it set them all, else engine-id order.

    local_rank is the launcher's too when it gave one, else the position among engines on the same host.
    """
    eids = sorted(identities)
    env_ranks = [identities[e]["env_rank"] for e in eids]
    from_launcher = None not in env_ranks and sorted(env_ranks) == list(range(len(eids)))
    rank = {e: (identities[e]["env_rank"] if from_launcher else i) for i, e in enumerate(eids)}
    by_rank = sorted(eids, key=rank.get)
    out = {}
    for e in eids:
        local = identities[e]["env_local_rank"] if from_launcher else None
        if local is None:
            local = [x for x in by_rank if identities[x]["host"] == identities[e]["host"]].index(e)
        out[e] = (rank[e], local)
    return out


def check(*, n: int, rollout_engines: Any) -> None:
    """`rollout_engines` against the `n` engines asked for, before anything starts."""
    if isinstance(rollout_engines, bool) or not isinstance(rollout_engines, int) or not 0 <= rollout_engines < n:
        raise ClusterConfigError(f"rollout_engines={rollout_engines!r} is not allowed; allowed: an integer from 0 to "
                                 f"n - 1 = {n - 1} (at least one engine trains)")


def split(ranks: dict[int, tuple[int, int]], rollout_engines: int) -> tuple[list[int], list[int]]:
    """(trainer engine ids, rollout engine ids), each in rank order: the rollout engines are the last ranks."""
    order = sorted(ranks, key=lambda e: ranks[e][0])
    cut = len(order) - rollout_engines
    return order[:cut], order[cut:]


def start_rollouts(handle: Any, *, ranks: dict[int, tuple[int, int]], idents: dict[int, dict], get: Any) -> None:
    """Give the rollout engines their GPU, Stop, heartbeat (under their launcher rank: `handle.status()` rows) and
    names (`role`, `link_rank`), then connect the link. `get(async_result, what=)`: cluster.py's bounded wait."""
    client, ids, monitor = handle.client, handle.rollout_ids, handle.monitor
    handle.rollout_ranks = [ranks[e][0] for e in ids]
    inits = [client[e].apply_async(on_engine.init_rollout, local_rank=ranks[e][1], rank=ranks[e][0],
                                   status_addr=handle.init_kwargs["master_addr"], status_port=handle.master_port,
                                   status_prefix=monitor.prefix, log_dir=handle.log_dir) for e in ids]
    names = [client[e].push(dict(role="rollout", link_rank=1 + i), block=False) for i, e in enumerate(ids)]
    names += [client[e].push(dict(role="trainer"), block=False) for e in handle.rank_of]
    for ar in names:
        get(ar, what="handing the engines their roles")
    started = [get(ar, what="preparing the rollout engines") for ar in inits]
    handle.rollout_devices = [i["device"] for i in started]
    handle.logs.update({r: i["log"] for r, i in zip(handle.rollout_ranks, started) if i["log"]})
    monitor.ranks = handle.ranks + handle.rollout_ranks
    monitor.idents.update({ranks[e][0]: idents[e] for e in ids})   # their pid: frozen or gone, as a trainer's
    handle.rollout_view = client[ids]
    relink(handle, get=get)


def relink(handle: Any, *, get: Any) -> None:
    """A new link between trainer rank 0 and every rollout engine (`link` in their namespaces), the old one's
    store and group dropped: after a Stop or a failure closed it."""
    client, kw = handle.client, handle.init_kwargs
    rank0, size = handle.engine_of[0], 1 + len(handle.rollout_ids)
    port = get(client[rank0].apply_async(ports.reserve, kw["master_addr"]), what=LINK_WHAT)
    link = dict(host=kw["master_addr"], port=port, size=size, backend=handle.backend)
    joins = [client[rank0].apply_async(on_engine.join_link, rank=0, **link)]
    joins += [client[e].apply_async(on_engine.join_link, rank=1 + i, **link) for i, e in enumerate(handle.rollout_ids)]
    others = [client[e].push(dict(link=None), block=False) for e in handle.rank_of if e != rank0]
    for ar in joins + others:
        get(ar, what=LINK_WHAT)
