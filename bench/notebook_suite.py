"""The notebook suite as `make test` runs it (nbval over every notebook in ONE pytest, `%%px` cells on the
engines `cluster.start()` gives: one per GPU, else 2 gloo CPU engines), timed per notebook and per cell.

    python bench/notebook_suite.py --out runs/bench/notebooks.json                   # every notebook
    python bench/notebook_suite.py notebooks/02_sft.ipynb notebooks/03_sync.ipynb    # a subset

A notebook's time is the sum of its cells' setup + call + teardown (pytest --durations=0): kernel and engine
start are in its first cell. Prints a table (each notebook, its slowest cells), writes every cell's time to the
JSON with the text each cell printed (`nb_outputs`: what a notebook showed, e.g. 09_tools' call rate and
accuracy) and exits with pytest's status, printing the failures. The knob MFSDP_MODEL picks the model (default tiny
mw in bf16 on GPUs, xs in fp32 on CPU); scripts/gpu_check.sh's `notebooks` section runs this on the GPUs.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time

import torch

from mfsdp_kit.perf.report import write_json

DURATION = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(\S+?\.ipynb)::(.+)$", re.M)


def run_suite(notebooks: list[str], *, cell_timeout_s: int,
              outputs: str) -> tuple[subprocess.CompletedProcess, float]:
    """One pytest over `notebooks`; each cell's printed text goes to the JSON-lines file `outputs` (`nb_outputs`)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--nbval-lax", "-p", "no:cacheprovider",
                           "-p", "bench.nb_outputs", f"--nbval-cell-timeout={cell_timeout_s}", "--durations=0",
                           "--durations-min=0", *notebooks],
                          capture_output=True, text=True, env={**os.environ, "MFSDP_NB_OUTPUTS": outputs})
    return proc, time.perf_counter() - t0


def printed(outputs: str) -> dict[str, dict[str, str]]:
    """{notebook: {cell: the text it printed}} from `nb_outputs`' file (empty when it was never written)."""
    found: dict[str, dict[str, str]] = {}
    if os.path.exists(outputs):
        for line in open(outputs):
            row = json.loads(line)
            found.setdefault(row["notebook"], {})[row["cell"]] = row["text"]
    return found


def per_notebook(stdout: str, notebooks: list[str]) -> list[dict]:
    """One row per notebook: ok, the sum of its cells' seconds, its 4 slowest cells, every cell's call seconds."""
    cells = [(float(m[1]), m[2], os.path.basename(m[3]), m[4]) for m in DURATION.finditer(stdout)]
    failed = [line for line in stdout.splitlines() if line.startswith("FAILED")]
    rows = []
    for nb in map(os.path.basename, notebooks):
        calls = sorted(((c, s) for s, when, n, c in cells if n == nb and when == "call"),
                       key=lambda cs: int(cs[0].split()[-1]))   # "Cell 10" after "Cell 9"
        rows.append(dict(notebook=nb, ok=not any(nb in line for line in failed),
                         cells_s=round(sum(s for s, _, n, _ in cells if n == nb), 1),
                         slowest_cells=[dict(cell=c, s=s) for c, s in sorted(calls, key=lambda cs: -cs[1])[:4]],
                         cells=[dict(cell=c, s=s) for c, s in calls]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="*", help="default: notebooks/*.ipynb")
    ap.add_argument("--cell-timeout-s", type=int, default=400)
    ap.add_argument("--out", default="runs/bench/notebooks.json")
    args = ap.parse_args()
    notebooks = args.notebooks or sorted(glob.glob("notebooks/*.ipynb"))
    outputs = f"{args.out}.outputs.jsonl"
    if os.path.exists(outputs):
        os.remove(outputs)
    proc, wall_s = run_suite(notebooks, cell_timeout_s=args.cell_timeout_s, outputs=outputs)
    rows = per_notebook(proc.stdout, notebooks)
    shown = printed(outputs)
    for r in rows:
        r["printed"] = shown.get(r["notebook"], {})
    for r in rows:
        print(f"{r['notebook']:<22} {'ok' if r['ok'] else 'FAILED':>6} {r['cells_s']:8.1f} s   "
              + ", ".join(f"{c['cell']} {c['s']:.1f} s" for c in r["slowest_cells"]), flush=True)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    on_gpu = torch.cuda.is_available()
    write_json(args.out, dict(model=os.environ.get("MFSDP_MODEL") or "auto",
                              dtype=os.environ.get("MFSDP_DTYPE") or "auto", gpus=torch.cuda.device_count(),
                              device=torch.cuda.get_device_name(0) if on_gpu else "cpu", total_s=round(wall_s, 1),
                              cells_s=round(sum(r["cells_s"] for r in rows), 1), pytest=last, notebooks=rows))
    print(f"{'total (one pytest)':<22} {wall_s:8.1f} s   {last}")
    if proc.returncode:   # the failures, not the durations table that follows them
        out = proc.stdout
        start, end = out.find("= FAILURES ="), out.find("slowest durations")
        print(out[start if start >= 0 else 0:end if end > start else None][-8000:], proc.stderr[-3000:])
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
