"""runtime: the rendezvous store listens on MASTER_ADDR only; re-init in one process works."""
import os
import subprocess
import sys

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
