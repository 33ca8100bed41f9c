"""bench/cluster_start.py end to end on CPU: 2 gloo engines started, all-reduced, restarted and stopped once by
the kit's own `cluster.start`, each phase of the start and of the stop accounted for (the script, not torchrun,
starts them); the engines load and train the tiny model before the restart and the stop."""
import json
import subprocess
import sys

import pytest

from tests.bench.cli import ROOT


def test_cluster_start_bench(tmp_path):
    out = tmp_path / "cs.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cluster_start.py"), "--n", "2", "--repeats", "1",
                           "--variants", "default", "--model", "xs",
                           "--import-floor", "torch,megatron.core", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["n_engines"] == 2 and list(res["variants"]) == ["default"]
    run, = res["variants"]["default"]["runs"]
    assert run["backend"] == "gloo" and len(run["devices"]) == 2
    assert 0 < run["start.total"] <= run["ready_s"]
    # the named phases of start() cover its total (the rest is the handle's own bookkeeping)
    phases = [k for k in run if k.startswith("start.") and not k.startswith("start.engine.") and k != "start.total"]
    assert 0.8 * run["start.total"] <= sum(run[k] for k in phases) <= run["start.total"] + 1e-6
    assert run["restart_s"] > 0 and run["stop_s"] > 0 and run["first_all_reduce_s"] > 0
    assert run["model_s"] > 0 and run["model_after_restart_s"] > 0     # the engines loaded and trained xs, twice
    stop_phases = ("stop.kill_engines", "stop.stop_cluster")
    assert sum(run[k] for k in stop_phases) == pytest.approx(run["stop.total"], abs=1e-3) and run["stop.total"] <= run["stop_s"]
    # two of the floors (the others import more of the same, ~6 s of this test)
    assert set(res["import_floor_s"]) == {"torch", "megatron.core"} and all(res["import_floor_s"].values())
