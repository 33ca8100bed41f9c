"""Run a bench/ script as a user does under torchrun: on gloo ranks (2 unless told), from the repository root,
with nothing added to PYTHONPATH (a script that needs more than the installed mfsdp_kit fails here). The
ranks are forked from the tests' warm server (tests/dist/pool.py), which spares each run the imports."""
import json
import os
from pathlib import Path

from tests.dist import launch

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, *flags: str, out: Path, timeout_s: float = 600, nproc: int = 2) -> dict:
    """`torchrun --nproc_per_node <nproc> bench/<script> <flags> --out <out>`; the JSON it wrote."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    ok, log = launch.run_script(ROOT / "bench" / script, *flags, "--out", str(out), nproc=nproc, timeout_s=timeout_s,
                                env=env, cwd=ROOT)
    assert ok, f"bench/{script} failed {log}"
    return json.loads(out.read_text())
