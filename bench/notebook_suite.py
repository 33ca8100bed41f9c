"""The notebook suite as `make test` runs it (nbval over every notebook in ONE pytest, `%%px` cells on the
engines `cluster.start()` gives: one per GPU, else 2 gloo CPU engines), timed per notebook and per cell.

    python bench/notebook_suite.py --out runs/bench/notebooks.json                   # every notebook
    python bench/notebook_suite.py notebooks/02_sft.ipynb notebooks/03_sync.ipynb    # a subset
    python bench/notebook_suite.py --jobs 3 --balance docs/results/h200x1/notebooks.json   # 3 pytests at once

With --jobs k, k pytests run at once, the notebooks dealt to them longest first by the times in --balance (a
notebooks.json of an earlier run): on a GPU node the notebooks' tiny models leave the GPU and most cores idle, so the
suite's wall time drops to about its longest notebook's; each notebook's own seconds then include the others' load.

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


def run_suite(notebooks: list[str], *, cell_timeout_s: int, outputs: str, jobs: int = 1,
              balance: str | None = None) -> tuple[int, list[tuple[str, str]], float]:
    """`jobs` pytests at once over `notebooks` (`deal`); each cell's printed text goes to the JSON-lines file
    `outputs` (`nb_outputs`). Returns (the worst return code, each pytest's (stdout, stderr), wall seconds)."""
    t0 = time.perf_counter()
    groups = deal(notebooks, jobs=jobs, balance=balance)
    procs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "--nbval-lax", "-p", "no:cacheprovider",
                               "-p", "bench.nb_outputs", f"--nbval-cell-timeout={cell_timeout_s}", "--durations=0",
                               "--durations-min=0", *group],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "MFSDP_NB_OUTPUTS": f"{outputs}.{i}"})
             for i, group in enumerate(groups)]
    done = [p.communicate() for p in procs]
    with open(outputs, "w") as joined:
        for i in range(len(groups)):
            if os.path.exists(f"{outputs}.{i}"):
                joined.write(open(f"{outputs}.{i}").read())
                os.remove(f"{outputs}.{i}")
    rc = max(p.returncode for p in procs)
    return rc, done, time.perf_counter() - t0


def deal(notebooks: list[str], *, jobs: int, balance: str | None) -> list[list[str]]:
    """The notebooks in `jobs` groups of about equal time: longest first, each to the group with the least so far
    (times from the notebooks.json `balance`; a notebook it lacks counts as its longest)."""
    seconds = {}
    if balance and os.path.exists(balance):
        seconds = {r["notebook"]: r["cells_s"] for r in json.load(open(balance))["notebooks"]}
    default = max(seconds.values(), default=1.0)
    groups: list[tuple[float, list[str]]] = [(0.0, []) for _ in range(max(1, min(jobs, len(notebooks))))]
    for nb in sorted(notebooks, key=lambda nb: -seconds.get(os.path.basename(nb), default)):
        i = min(range(len(groups)), key=lambda i: groups[i][0])
        groups[i] = (groups[i][0] + seconds.get(os.path.basename(nb), default), groups[i][1] + [nb])
    return [sorted(g) for _, g in groups if g]


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
    ap.add_argument("--jobs", type=int, default=1, help="pytests at once (default 1: one pytest, as make test)")
    ap.add_argument("--balance", help="an earlier notebooks.json whose times deal the notebooks to the jobs")
    args = ap.parse_args()
    notebooks = args.notebooks or sorted(glob.glob("notebooks/*.ipynb"))
    outputs = f"{args.out}.outputs.jsonl"
    if os.path.exists(outputs):
        os.remove(outputs)
    rc, done, wall_s = run_suite(notebooks, cell_timeout_s=args.cell_timeout_s, outputs=outputs,
                                 jobs=args.jobs, balance=args.balance)
    stdout = "\n".join(out for out, _ in done)
    rows = per_notebook(stdout, notebooks)
    shown = printed(outputs)
    for r in rows:
        r["printed"] = shown.get(r["notebook"], {})
    for r in rows:
        print(f"{r['notebook']:<22} {'ok' if r['ok'] else 'FAILED':>6} {r['cells_s']:8.1f} s   "
              + ", ".join(f"{c['cell']} {c['s']:.1f} s" for c in r["slowest_cells"]), flush=True)
    last = " | ".join((out.strip().splitlines() or [""])[-1] for out, _ in done)   # each pytest's summary line
    on_gpu = torch.cuda.is_available()
    write_json(args.out, dict(model=os.environ.get("MFSDP_MODEL") or "auto",
                              dtype=os.environ.get("MFSDP_DTYPE") or "auto", gpus=torch.cuda.device_count(),
                              device=torch.cuda.get_device_name(0) if on_gpu else "cpu", jobs=args.jobs,
                              total_s=round(wall_s, 1),
                              cells_s=round(sum(r["cells_s"] for r in rows), 1), pytest=last, notebooks=rows))
    print(f"{f'total ({args.jobs} pytest at once)':<22} {wall_s:8.1f} s   {last}")
    if rc:   # the failures, not the durations tables that follow them
        for out, err in done:
            start, end = out.find("= FAILURES ="), out.find("slowest durations")
            print(out[start if start >= 0 else 0:end if end > start else None][-8000:], err[-3000:])
    sys.exit(rc)


if __name__ == "__main__":
    main()
