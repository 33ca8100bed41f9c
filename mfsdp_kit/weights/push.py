"""Weights pushed from the trainer to rollout processes over a collective, tagged with a policy version.

Decoupled rollouts (docs/design.md, "Decoupled rollouts"): rollout processes sample with one policy while the trainer
updates the next. They are not ranks of the trainer's world: megatron builds its groups over the whole default world,
so a rollout process there would become a data-parallel rank. Instead a `Link` is a process group of its own, built
from its own TCPStore: the trainer's rank 0 (link rank 0, the sender) and every rollout process (link ranks 1..).
Megatron's state never sees it, and the rollout processes need no world of their own.

    # trainer ranks                                       # each rollout process (link rank r >= 1)
    link = push.connect(host=, port=, rank=0, size=1 + R)  link = push.connect(host=, port=, rank=r, size=1 + R)
    push.send(chunks, bridge, link=link, version=k)      version = push.receive(model, link=link)
    (trainer ranks other than 0 pass link=None: the export's all-gathers are collective in the trainer's world)

The stream is the HF export itself (`sync.export_hf_weights`, one FSDP unit gathered at a time): per tensor a
fixed-size header (its HF name, shape and dtype as JSON, `HEADER_BYTES` bytes) then its bytes, broadcast from link
rank 0; a last header carries the version. The receiver copies each tensor into the parameter of that name and
checks the set at the end: a name it lacks, a shape that differs or a parameter never sent fails the receive after
the stream is drained, so the sender is never left blocked in a broadcast.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..distributed import engine, runtime
from . import sync

HEADER_BYTES = 1024
"""Bytes of one tensor's header (JSON, NUL-padded): an HF name up to a few hundred characters fits."""
STORE_PREFIX = "mfsdp_kit.push"
"""The link's keys in its TCPStore."""
CLOSED_KEY = "closed"
"""Set (to the reason) once a member closed the link (`close`)."""


class LinkClosed(RuntimeError):
    """A member closed the link (Stop, a failure); the message is the reason it gave."""


@dataclass
class Link:
    """One side of the trainer -> rollout link."""

    group: object
    """The link's own process group (gloo or NCCL), outside the default world; None once this member `close`d it."""
    rank: int
    """This process's rank in it: 0 sends (the trainer's rank 0), 1.. receive."""
    size: int
    """1 + the number of rollout processes."""
    device: torch.device
    """Where the link's tensors live: CPU for gloo, this process's GPU for NCCL."""
    store: object
    """The link's key-value store (prefixed): for small messages beside the weights (acknowledgements, results)."""


def connect(*, host: str, port: int, rank: int, size: int, backend: str = "gloo", timeout_s: int = 600) -> Link:
    """Join the link at `host:port` (rank 0 hosts its TCPStore there); every member calls it, each waits for all
    `size` (seconds up to `timeout_s`)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not allowed; allowed: gloo | nccl")
    if not 0 <= rank < size:
        raise ValueError(f"rank={rank} is not allowed; allowed: 0 <= rank < size={size}")
    timeout = timedelta(seconds=timeout_s)   # rank 0's store listens on `host` only, as the world's does
    store = dist.PrefixStore(STORE_PREFIX, runtime.new_tcp_store(addr=host, port=port, rank=rank, world_size=size,
                                                                  timeout=timeout, agent=False))
    if backend == "gloo":
        link = Link(dist.ProcessGroupGloo(store, rank, size, timeout), rank, size, torch.device("cpu"), store)
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        link = Link(dist.ProcessGroupNCCL(store, rank, size, options), rank, size,
                    torch.device("cuda", torch.cuda.current_device()), store)
    _abort_when_closed(link, host=host, port=port)
    return link


def _abort_when_closed(link: Link, *, host: str, port: int) -> None:
    """A daemon thread that aborts this member's group once another member closed the link: NCCL's abort wakes a
    broadcast waiting here (gloo's does not, but the closer's sockets closing does). It waits on a store connection
    of its own (GIL released) and ends with the store's server."""
    watcher = dist.PrefixStore(STORE_PREFIX, dist.TCPStore(host, port, is_master=False, timeout=timedelta(days=1)))

    def watch() -> None:
        try:
            watcher.wait([CLOSED_KEY])
        except (RuntimeError, dist.DistError):   # the server (the trainer's rank 0) is gone: nothing to wake
            return
        if (group := link.group) is not None:
            group.abort()
    threading.Thread(target=watch, name="mfsdp_kit-link-closed", daemon=True).start()


def close(link: Link, *, reason: str) -> None:
    """End the link for every member: its store says `reason` (the first member's stays) and this member's group is
    aborted, so a peer waiting in a broadcast on it returns with an error (gloo: the sockets close under it), which
    `receive` / `send` then raise as `LinkClosed(reason)`."""
    try:
        link.store.compare_set(CLOSED_KEY, "", reason)
    except (RuntimeError, dist.DistError):   # the store's server (link rank 0's process) is gone: no one to tell
        pass
    group, link.group = link.group, None   # gloo's abort leaves the sockets open: dropping the group closes them
    if group is not None:
        group.abort()


def closed(link: Link) -> str | None:
    """Why the link was closed, or None while it is open (no wait)."""
    return link.store.get(CLOSED_KEY).decode() if link.store.check([CLOSED_KEY]) else None


def check_open(link: Link) -> None:
    """Raise `LinkClosed` with its reason once a member closed the link."""
    if (reason := closed(link)) is not None:
        raise LinkClosed(reason)


def _broadcast(link: Link, tensor: torch.Tensor) -> None:
    if link.group is None:   # this member closed it
        raise LinkClosed(closed(link) or "closed")
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    try:
        link.group.broadcast([tensor], options).wait()
    except (RuntimeError, dist.DistBackendError) as err:   # a peer closed it: say why, not "connection reset"
        if (reason := closed(link)) is not None:
            raise LinkClosed(reason) from err
        raise


def _header(link: Link, meta: dict | None = None) -> dict:
    """Send `meta` (link rank 0) or receive it (the others)."""
    buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8, device=link.device)
    if meta is not None:
        raw = json.dumps(meta).encode()
        if len(raw) > HEADER_BYTES:
            raise ValueError(f"push: a header of {len(raw)} bytes; at most HEADER_BYTES={HEADER_BYTES}: {meta}")
        buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    _broadcast(link, buf)
    return json.loads(bytes(buf.cpu().tolist()).rstrip(b"\0")) if meta is None else meta


def send(chunks: list[torch.nn.Module], bridge, *, link: Link | None, version: int) -> dict:
    """Push every HF weight of `chunks` to the link's rollout processes, tagged `version` (an int the caller counts:
    the optimizer steps so far, say). Every trainer rank calls it; the one holding `link` (rank 0 of it) sends.
    Returns {"seconds", "bytes", "tensors", "version"}. A link closed meanwhile raises `LinkClosed` on every trainer
    rank, after the export (collective in the trainer's world) has run to its end on all of them."""
    if link is not None and link.rank != 0:
        raise ValueError(f"push.send: link rank {link.rank}; only link rank 0 (the trainer's) sends")
    start, nbytes, count, problem = time.perf_counter(), 0, 0, None
    engine.synchronize_fsdp_params(chunks)
    try:
        for name, tensor in sync.export_hf_weights(chunks, bridge, cpu=False):
            count += 1
            nbytes += tensor.numel() * tensor.element_size()
            if link is None or problem is not None:
                continue
            try:
                _header(link, dict(name=name, shape=list(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch.")))
                _broadcast(link, tensor.to(link.device).contiguous())
            except LinkClosed as closed:   # the other trainer ranks are in the export's all-gathers: go on with them
                problem = str(closed)
    finally:
        engine.restore_fsdp_params(chunks)
    if link is not None and problem is None:
        try:
            _header(link, dict(end=True, version=version, tensors=count))
        except LinkClosed as closed:
            problem = str(closed)
    if (problem := runtime.broadcast(problem)) is not None:   # rank 0's, on every trainer rank
        raise LinkClosed(problem)
    return dict(seconds=time.perf_counter() - start, bytes=nbytes, tensors=count, version=version)


@torch.no_grad()
def receive(model: torch.nn.Module, *, link: Link) -> int:
    """Receive one push into `model`'s parameters and buffers in place (by HF name); returns its version. Raises
    KeyError / ValueError naming the first mismatch once the whole stream is drained."""
    if link.rank == 0:
        raise ValueError("push.receive: link rank 0 is the sender")
    targets = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    seen, problems = set(), []
    while True:
        meta = _header(link)
        if meta.get("end"):
            break
        buf = torch.empty(meta["shape"], dtype=getattr(torch, meta["dtype"]), device=link.device)
        _broadcast(link, buf)
        target = targets.get(meta["name"])
        if target is None:
            problems.append(KeyError(f"pushed weight {meta['name']!r} has no counterpart in {type(model).__name__}"))
        elif tuple(target.shape) != tuple(buf.shape):
            problems.append(ValueError(f"pushed weight {meta['name']!r}: shape {tuple(buf.shape)}, "
                                       f"{type(model).__name__} has {tuple(target.shape)}"))
        else:
            target.copy_(buf.to(device=target.device, dtype=target.dtype))
            seen.add(meta["name"])
    missing = [n for n, _ in model.named_parameters() if n not in seen]
    if not problems and missing:
        problems.append(KeyError(f"{len(missing)} weights of {type(model).__name__} were not pushed, "
                                 f"e.g. {missing[:3]}"))
    if problems:
        raise problems[0]
    return int(meta["version"])
