"""A rendezvous port held from the moment it is picked until rank 0's store listens on it.

The naive way picks a free port (bind to port 0, read it, close) and binds it again later. In
between -- on an ipyparallel engine, the seconds its torch and megatron imports take -- the
kernel may hand the same port to anything else that binds to port 0 (a gloo pair, another job's
store), and `init` fails with EADDRINUSE (CI, 2026-12-05). `reserve` binds and listens at once and
keeps the socket; `runtime.init` on rank 0 takes it (`take`) and hands its descriptor to the
TCPStore, so the port is never free in between. Connections that arrive before the store starts
wait in the listen backlog.
"""
from __future__ import annotations

import socket

_held: dict[tuple[str, int], socket.socket] = {}
"""(addr, port) -> the listening socket this process reserved and has not handed over yet."""


def reserve(addr: str = "127.0.0.1") -> int:
    """A TCP port on `addr` that this process listens on until `take` hands it over.

    One reservation per process: a new one closes an older one never taken (a world that failed to start)."""
    release()
    sock = socket.create_server((addr, 0), reuse_port=False)
    port = sock.getsockname()[1]
    _held[(addr, port)] = sock
    return port


def take(addr: str, port: int) -> socket.socket | None:
    """The socket `reserve` holds for (addr, port), now the caller's to own; None if none is held."""
    return _held.pop((addr, port), None)


def release() -> None:
    """Close every reservation not taken."""
    while _held:
        _held.popitem()[1].close()
