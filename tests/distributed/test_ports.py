"""ports: a reserved rendezvous port stays taken until rank 0's store takes the socket over."""
import errno
import os
import socket
import subprocess
import sys

import pytest

from mfsdp_kit.distributed import ports


def _bind_fails(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as err:
            assert err.errno == errno.EADDRINUSE, err
            return True
    return False


def test_a_reserved_port_cannot_be_bound_by_anyone_else_until_released():
    port = ports.reserve("127.0.0.1")
    try:
        assert _bind_fails(port)
        newer = ports.reserve("127.0.0.1")   # one reservation per process: the older one is closed
        assert newer != port and _bind_fails(newer) and not _bind_fails(port)
        sock = ports.take("127.0.0.1", newer)
        assert sock is not None and ports.take("127.0.0.1", newer) is None   # handed over once
        sock.close()
        assert not _bind_fails(newer)
    finally:
        ports.release()


SCRIPT = """
import psutil
from mfsdp_kit import runtime
from mfsdp_kit.config import EngineConfig
from mfsdp_kit.distributed import ports
port = ports.reserve("127.0.0.1")
runtime.init(EngineConfig(), rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
listening = [c for c in psutil.Process().net_connections(kind="tcp")
             if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
assert ports.take("127.0.0.1", port) is None, "init did not take the reserved socket"
runtime.shutdown(destroy_process_group=True)
print("LISTENING", len(listening))
"""


def test_rank_0s_store_listens_on_the_reserved_socket():
    """Without the hand-over, rank 0's bind of its own reserved port fails with EADDRINUSE."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_", "RANK", "WORLD_SIZE"))}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LISTENING 1" in out.stdout, out.stdout


def test_unclaimed_ports_lie_below_the_ephemeral_range_and_are_free():
    low = ports.ephemeral_start()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        assert low == int(f.read().split()[0])
    picked = {ports.unclaimed("127.0.0.1") for _ in range(20)}
    assert all(ports.LOWEST <= p < low for p in picked) and len(picked) > 1, picked   # drawn, not one fixed port
    port = picked.pop()
    assert not _bind_fails(port)
    with socket.create_server(("127.0.0.1", port)):   # held: a pick never returns it
        assert port not in {ports.unclaimed("127.0.0.1") for _ in range(200)}


def test_a_reservation_under_another_spelling_of_the_address_is_freed_for_the_taker():
    port = ports.reserve("127.0.0.1")
    assert ports.take("localhost", port) is None and not _bind_fails(port)   # closed: the caller binds it itself


def test_ipv6_loopback_is_reserved_and_drawn_on_its_own_family():
    try:
        port = ports.reserve("::1")
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    try:
        with socket.socket(socket.AF_INET6) as s:
            try:
                s.bind(("::1", port))
            except OSError as err:
                assert err.errno == errno.EADDRINUSE
            else:
                raise AssertionError("the reserved IPv6 port was free")
        assert ports.unclaimed("::1") != port
    finally:
        ports.release()
