"""Run a bench/ script as a user does: under torchrun on gloo ranks (2 unless told), from the repository root,
with nothing added to PYTHONPATH (a script that needs more than the installed mfsdp_kit fails here)."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.dist.launch import free_port

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, *flags: str, out: Path, timeout_s: float = 600, nproc: int = 2) -> dict:
    """`torchrun --nproc_per_node <nproc> bench/<script> <flags> --out <out>`; the JSON it wrote."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(ROOT / "bench" / script), *flags, "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())
