"""Savers serialise on `latest` (issue 51): two saver processes into one root and a loader, 200 rounds each.

Without the lock, each saver checked "not below `latest`" at its start and moved `latest` at its commit, so the
slower one could move it back (`latest` 59 while step_000060 existed, in 1 of 2 runs of the battery). Here the
loader, holding the root's lock shared, must always see `latest` on the newest committed step, every load
must return the values of the step it names, and every refused save must say it would move `latest` backwards.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mfsdp_kit import checkpoint as ckpt

ROUNDS = 200
RACER = """
import json, sys, time
from pathlib import Path
import torch
from mfsdp_kit import checkpoint as ckpt
from mfsdp_kit.checkpoint import steps

role, root, out, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

class Value:
    def __init__(self, v):
        self.t = torch.full((2,), float(v))
    def state_dict(self):
        return {"t": self.t}
    def load_state_dict(self, sd):
        self.t.copy_(sd["t"])

mgr = ckpt.CheckpointManager(root)
report = dict(saved=[], refused=[], seen=0, wrong=[], loads=0)
if role == "loader":
    stop = time.monotonic() + 300
    while time.monotonic() < stop and not Path(out + ".stop").exists():
        if not Path(root, steps.LOCK_NAME).exists():
            continue
        with steps.locked(Path(root), shared=True):
            latest, listed = mgr.latest(), mgr.list()
        report["seen"] += 1
        if listed and latest != max(listed):
            report["wrong"].append(["latest", latest, max(listed)])
        if latest is not None:
            into = Value(-1)
            meta = mgr.load({"v": into}, step=latest)
            report["loads"] += 1
            if float(into.t[0]) != meta["step"] or meta["step"] != latest:
                report["wrong"].append(["load", latest, meta["step"], float(into.t[0])])
else:
    me = int(role[-1])
    for r in range(rounds):
        step = 2 * r + me
        try:
            mgr.save(step, {"v": Value(step)})
            report["saved"].append(step)
        except ckpt.CheckpointError as e:
            report["refused"].append([step, str(e)[:400]])
json.dump(report, open(out, "w"))
"""


def _racer(role: str, root: Path, out: Path) -> subprocess.Popen:
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", RACER, role, str(root), str(out), str(ROUNDS)], env=env)


def test_two_savers_and_a_loader_keep_latest_on_the_newest_step(tmp_path):
    root = tmp_path / "ckpt"
    loader = _racer("loader", root, tmp_path / "loader.json")
    savers = [_racer(f"saver{i}", root, tmp_path / f"saver{i}.json") for i in (0, 1)]
    for p in savers:
        assert p.wait(timeout=600) == 0
    (tmp_path / "loader.json.stop").touch()
    assert loader.wait(timeout=300) == 0
    done = [json.loads((tmp_path / f"saver{i}.json").read_text()) for i in (0, 1)]
    seen = json.loads((tmp_path / "loader.json").read_text())
    saved = sorted(s for d in done for s in d["saved"])
    refused = [r for d in done for r in d["refused"]]
    print(f"saved {len(saved)}, refused {len(refused)}, loader saw {seen['seen']} and loaded {seen['loads']}")
    assert len(saved) + len(refused) == 2 * ROUNDS and saved
    assert all("would move `latest` backwards" in text for _, text in refused), refused[:3]
    mgr = ckpt.CheckpointManager(root)
    assert mgr.list() == saved and mgr.latest() == max(saved) == saved[-1]
    assert seen["wrong"] == [] and seen["loads"] > 0
    assert not [p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".probe-", ".latest-"))]
