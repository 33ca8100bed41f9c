"""`import mfsdp_kit` changes nothing in torch or megatron; `runtime.init` makes the process-wide installs."""
import os
import subprocess
import sys

from tests.dist.launch import free_port

IMPORT_ONLY = """
import os, sys, torch
import mfsdp_kit, mfsdp_kit.config, mfsdp_kit.distributed.engine, mfsdp_kit.checkpoint
import megatron.core.jit as jit
from mfsdp_kit.compat import registry
kit_finders = [f for f in sys.meta_path if type(f).__module__.startswith("mfsdp_kit")]
print(int(jit.jit_fuser is torch.compile), len(kit_finders), os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
      len(registry.ACTIVE))
"""

INIT = """
import os, sys, torch
from mfsdp_kit import runtime
from mfsdp_kit.config import EngineConfig
runtime.init(EngineConfig(), rank=0, world_size=1, master_port=int(sys.argv[1]))
import megatron.core.jit as jit
from mfsdp_kit.compat.patches import lazy_compile
from mfsdp_kit.compat import registry
print(int(jit.jit_fuser is torch.compile), int(lazy_compile.PATCH in registry.ACTIVE),
      os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
runtime.shutdown(destroy_process_group=True)
"""


def env() -> dict:
    out = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    return {**out, "ATEN_CPU_CAPABILITY": "default"}


def test_importing_the_kit_changes_nothing_in_torch_or_megatron():
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", IMPORT_ONLY], env=env(), capture_output=True,
                         text=True, check=True).stdout.split()
    eager, finders, cache, active = out[-4:]
    assert (eager, finders, active) == ("1", "0", "0"), out
    assert not cache.endswith("_default"), out   # megatron's eager import may set inductor's own default


def test_runtime_init_installs_them_before_importing_megatron():
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", INIT, str(free_port())], env=env(),
                         capture_output=True, text=True, check=True).stdout.split()
    eager, recorded, cache = out[-3:]
    assert eager == "0" and recorded == "1" and cache.endswith("_default"), out
