"""What a set of processes listens on (psutil), for the tests that check a server binds where it should and that
nothing is left listening after a stop."""
from __future__ import annotations

import os

import psutil


def listening(procs) -> set[tuple[str, int]]:
    """(address, port) of every listening inet socket of `procs`; a process that exited since it was listed (servers
    run short-lived helpers) listens on nothing."""
    out = set()
    for p in procs:
        try:
            out |= {(c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
    return out


def still_listening(ports, pgids) -> set[int]:
    """Which of `ports` a process of the process groups `pgids` still listens on, machine-wide. Only those groups
    count: make test runs two workers, and the other's servers may bind a port number this test's stopped
    processes freed. A process of those groups that was never listed (a forked helper) still counts."""
    held = set()
    for c in psutil.net_connections(kind="inet"):
        if c.status != psutil.CONN_LISTEN or c.laddr.port not in ports:
            continue
        try:
            ours = c.pid is None or os.getpgid(c.pid) in pgids   # an owner psutil cannot name counts as ours
        except ProcessLookupError:   # it exited meanwhile
            continue
        if ours:
            held.add(c.laddr.port)
    return held
