"""Run a scenario on N gloo ranks under torchrun and return rank 0's result dict.

Scenarios are functions in tests/dist/scenarios.py taking keyword arguments and returning a
JSON-able dict (rank 0's is kept). Each call is a fresh set of processes, as a user's job is.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(scenario: str, *, nproc: int = 2, timeout_s: float = 600, **kwargs) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", "--master_addr=127.0.0.1",
               str(HERE / "worker.py"), scenario, json.dumps(kwargs), str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        if proc.returncode != 0 and "EADDRINUSE" in proc.stderr:  # the free port was taken meanwhile: once more
            cmd[4] = f"--master_port={free_port()}"
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        if proc.returncode != 0 or not out.exists():
            raise AssertionError(f"{scenario} failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        return json.loads(out.read_text())
