"""runtime: the rendezvous store listens on MASTER_ADDR only; re-init in one process works; bad launch
arguments are ConfigErrors."""
import os
import socket
import subprocess
import sys

import pytest
import torch

from mfsdp_kit.config import EngineConfig
from tests.dist import launch
from tests.dist.launch import free_port

SCRIPT = """
import psutil, sys
from mfsdp_kit import runtime
from mfsdp_kit.config import EngineConfig
port = int(sys.argv[1])
runtime.init(EngineConfig(), rank=0, world_size=1, master_port=port)
listen = [c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
          if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
runtime.init(EngineConfig(seed=5))          # a new layout over the same world
runtime.shutdown(destroy_process_group=True)
print("LISTEN", listen)
"""


def test_store_binds_loopback_only_and_reinit_works():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_", "RANK", "WORLD_SIZE"))}
    port = free_port()
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(port)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LISTEN ['127.0.0.1']" in out.stdout, out.stdout


@pytest.mark.parametrize("own_store", [True, False], ids=["kit-store", "torchrun-store"])
def test_three_init_shutdown_cycles_in_one_process(own_store):
    """init after shutdown(destroy_process_group=True) rendezvouses again on the same store address,
    under a fresh key prefix; each cycle all-reduces over the world and a megatron group."""
    r = launch.run("reinit_cycles", cycles=3, port=free_port() if own_store else None, timeout_s=120,
                   torchrun=not own_store)   # the agent store exists under torchrun only
    assert r["sums"] == [3.0 * 2] * 3 and r["dp_sizes"] == [2, 2, 2], r   # (1 + 2) all-reduced twice
    print("seconds per cycle", r["seconds"])   # a hang fails through launch's timeout_s, not a clock assert


@pytest.mark.parametrize("kwargs,field", [
    (dict(backend="mpi"), "backend"), (dict(world_size=0), "world_size"), (dict(rank=2, world_size=2), "rank"),
    (dict(rank=True, world_size=2), "rank"), (dict(timeout_s=0), "timeout_s"), (dict(local_rank=-1), "local_rank")])
def test_bad_launch_arguments_are_config_errors_before_any_socket(kwargs, field):
    from mfsdp_kit import runtime
    from mfsdp_kit.config import ConfigError
    dist = torch.distributed
    before = dist.is_initialized() and dist.distributed_c10d._get_default_group()  # an earlier test's world
    with pytest.raises(ConfigError, match=rf"^{field}=") as e:
        runtime.init(EngineConfig(), **{"rank": 0, "world_size": 1, **kwargs})
    assert "allowed:" in str(e.value) and isinstance(e.value, ValueError)
    assert (dist.is_initialized() and dist.distributed_c10d._get_default_group()) == before  # nothing was built


def test_loopback_interface_is_found_and_loopback_addresses_are_recognised():
    from mfsdp_kit import runtime
    name = runtime.loopback_interface()
    assert name is not None and name in dict(socket.if_nameindex()).values()
    assert runtime.is_loopback("127.0.0.1") and runtime.is_loopback("localhost") and runtime.is_loopback("::1")
    assert not runtime.is_loopback("192.0.2.7")
