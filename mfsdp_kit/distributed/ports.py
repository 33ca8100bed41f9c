"""A rendezvous port held from the moment it is picked until rank 0's store listens on it.

The naive way picks a free port (bind to port 0, read it, close) and binds it again later. In
between -- on an ipyparallel engine, the seconds its torch and megatron imports take -- the
kernel may hand the same port to anything else that binds to port 0 (a gloo pair, another job's
store), and `init` fails with EADDRINUSE (CI, 2026-12-05). `reserve` binds and listens at once and
keeps the socket; `runtime.init` on rank 0 takes it (`take`) and hands its descriptor to the
TCPStore, so the port is never free in between. Connections that arrive before the store starts
wait in the listen backlog.

A server in another process (torchrun's agent, jupyter) cannot take a socket over. For it, `unclaimed` picks a
port below the kernel's ephemeral range: binds to port 0 and outgoing connections draw from that range, so
nothing takes a port below it by chance between the pick and the server's bind.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10000
"""The lowest port `unclaimed` picks (below are well-known services' ports)."""

_held: dict[tuple[str, int], socket.socket] = {}
"""(addr, port) -> the listening socket this process reserved and has not handed over yet."""


def reserve(addr: str = "127.0.0.1") -> int:
    """A TCP port on `addr` that this process listens on until `take` hands it over.

    One reservation per process: a new one closes an older one never taken (a world that failed to start)."""
    release()
    sock = socket.create_server((addr, 0), family=family(addr), reuse_port=False)
    port = sock.getsockname()[1]
    _held[(addr, port)] = sock
    return port


def take(addr: str, port: int) -> socket.socket | None:
    """The socket `reserve` holds for (addr, port), now the caller's to own; None if none is held. A reservation of
    `port` under another spelling of the address ("localhost") is closed, so the caller's own bind of the port
    cannot collide with it."""
    sock = _held.pop((addr, port), None)
    if sock is None and any(p == port for _, p in _held):
        release()
    return sock


def release() -> None:
    """Close every reservation not taken."""
    while _held:
        _held.popitem()[1].close()


def family(addr: str) -> socket.AddressFamily:
    """IPv6 for an address with a colon ("::1"), else IPv4."""
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux: /proc/sys/net/ipv4/ip_local_port_range; 32768 if
    unreadable, Linux's default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def unclaimed(host: str = "127.0.0.1", *, tries: int = 100) -> int:
    """A port free on `host` now, drawn at random from [LOWEST, the ephemeral range's start), for a server that
    another process binds."""
    high = ephemeral_start()
    if high <= LOWEST:   # no room below: the kernel's pick
        with socket.socket(family(host)) as sock:
            sock.bind((host, 0))
            return sock.getsockname()[1]
    for _ in range(tries):
        port = random.randrange(LOWEST, high)
        if is_free(host, port):
            return port
    raise OSError(f"no free port on {host} in [{LOWEST}, {high}) after {tries} draws")


def is_free(host: str, port: int) -> bool:
    """Whether `port` on `host` can be bound now (nobody holds it)."""
    with socket.socket(family(host)) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
