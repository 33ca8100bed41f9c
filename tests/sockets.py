"""What a set of processes listens on (psutil), for the tests that check a server binds where it should and that
nothing is left listening after a stop."""
from __future__ import annotations

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
