"""bench/notebook_suite.py on one notebook, on CPU: every cell timed, the table printed, pytest's status kept.
The notebook is widgets_demo, the one that starts no engines: the script times whatever nbval runs, and make test's
notebooks part runs every notebook (00_cluster's engines included) anyway."""
import json
import subprocess
import sys

from tests.bench.cli import ROOT


def test_notebook_suite_times_every_cell(tmp_path):
    out = tmp_path / "nb.json"
    proc = subprocess.run([sys.executable, "bench/notebook_suite.py", "notebooks/widgets_demo.ipynb",
                           "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    [row] = res["notebooks"]
    assert row["notebook"] == "widgets_demo.ipynb" and row["ok"] and res["device"] == "cpu"
    assert [c["cell"] for c in row["cells"]] == [f"Cell {i}" for i in range(5)]       # in order, every cell
    assert row["cells_s"] >= sum(c["s"] for c in row["cells"]) > 0                      # + setup and teardown
    assert "widgets_demo.ipynb" in proc.stdout and "passed" in res["pytest"]
    assert row["printed"] and all(isinstance(t, str) and t.strip() for t in row["printed"].values())   # what it showed
