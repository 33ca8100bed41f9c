"""Loopback means loopback: a local world listens on 127.0.0.1 only -- controller, engines, store and gloo.

gloo picks its listening address from the hostname, not MASTER_ADDR; on this test VM the hostname
resolves to 127.0.0.1, which would make the check vacuous. So, when root, the check runs in a
private mount namespace whose /etc/hosts maps the hostname to this machine's network address
(as on most real hosts); otherwise it checks the machine as it is.
"""
import json
import os
import shlex
import shutil
import socket
import sys

import psutil

from tests.dist import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import json, os, sys, time
import psutil
sys.path.insert(0, sys.argv[1])
t0 = time.monotonic()
def stage(name):   # to stderr, unbuffered: a run cut off by the timeout shows how far it got
    print(f"[{time.monotonic() - t0:6.1f} s] {name}", file=sys.stderr, flush=True)
from mfsdp_kit import cluster
from tests.dist import launch

stage("starting 2 engines")
h = cluster.start(2, timeout_s=60)
try:
    stage("all-reduce on the engines")
    h.run("import torch, torch.distributed as dist\\nx = torch.tensor([1.0])\\ndist.all_reduce(x)", timeout_s=60)
    engines = h.apply(os.getpid, timeout_s=60)
    pids = {p.pid for p in psutil.Process().children(recursive=True)} | set(engines)   # controller + engines
    cluster_listen = [c.laddr.ip for pid in pids for c in psutil.Process(pid).net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN]
    h.run("import os\\nifname = os.environ.get('GLOO_SOCKET_IFNAME')", timeout_s=60)
    engine_envs = h.view["ifname"]
finally:
    stage("stopping the engines")
    h.stop()
stage("torchrun")
torchrun = launch.run("listening_addresses", torchrun=True, timeout_s=120)   # torchrun with --master_addr=127.0.0.1
stage("done")
import socket
print("RESULT", json.dumps(dict(hostname_ip=socket.gethostbyname(socket.gethostname()), engines=engines,
                                cluster=cluster_listen, engine_gloo_ifname=engine_envs, torchrun=torchrun)))
"""


def _network_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (e.g. eth0's), or None."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def _command(tmp_path) -> tuple[list[str], str | None]:
    """The script, inside a namespace where the hostname resolves to the network address when we can."""
    run = [sys.executable, "-W", "ignore", "-c", SCRIPT, ROOT]
    address = _network_address()
    if os.geteuid() != 0 or not shutil.which("unshare") or address is None:
        return run, None
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")
    inner = f"mount --bind {shlex.quote(str(hosts))} /etc/hosts && exec {shlex.join(run)}"
    return ["unshare", "--mount", "sh", "-c", inner], address


def test_local_cluster_and_torchrun_listen_on_loopback_only(tmp_path):
    cmd, address = _command(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    code, out, err = launch.run_group(cmd, timeout_s=300, env=env)
    assert code == 0, f"exit code {code} (None: timed out, its stages so far below)\n{err[-4000:]}"
    r = json.loads(out.split("RESULT ", 1)[1])
    if address is not None:   # the namespace worked: gloo's hostname lookup would give the network address
        assert r["hostname_ip"] == address, r
    assert len(r["cluster"]) > 10, r   # controller (~10 ports), engines' kernels, store, gloo pairs
    assert set(r["cluster"]) == {"127.0.0.1"}, r
    assert all(set(per_rank) == {"127.0.0.1"} for per_rank in r["torchrun"]["listening"]), r
    lo = next(n for n, addrs in psutil.net_if_addrs().items() if any(a.address == "127.0.0.1" for a in addrs))
    assert r["engine_gloo_ifname"] == [lo, lo] and r["torchrun"]["gloo_ifname"] == lo, r


def test_user_gloo_interface_wins(monkeypatch):
    from mfsdp_kit.distributed import runtime
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    runtime.sockets_on_loopback_if_master_is("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7" and os.environ["NCCL_SOCKET_IFNAME"] == runtime.loopback_interface()
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    runtime.sockets_on_loopback_if_master_is("10.1.2.3")   # a multi-node master: the user's network choice
    assert "NCCL_SOCKET_IFNAME" not in os.environ
