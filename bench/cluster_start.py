"""Start-to-ready time of `cluster.start` (engines up, ranks assigned, process group formed).

    python bench/cluster_start.py [--n 2] [--repeats 5] [--out runs/bench/cluster_start.json]

"Ready" means `start()` returned: every engine registered, ran `runtime.init`, and %%px would work.
Stop time is measured too, since a notebook pays it on every restart.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time


def measure_once(*, n_engines: int) -> dict:
    from mfsdp_kit import cluster
    t0 = time.perf_counter()
    handle = cluster.start(n_engines)
    ready_s = time.perf_counter() - t0
    handle.run("import torch, torch.distributed as dist\nx = torch.ones(1)\ndist.all_reduce(x)")
    first_collective_s = time.perf_counter() - t0 - ready_s
    t1 = time.perf_counter()
    handle.stop()
    return dict(ready_s=ready_s, first_all_reduce_s=first_collective_s, stop_s=time.perf_counter() - t1,
                backend=handle.backend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2, help="engines per start")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="runs/bench/cluster_start.json")
    args = parser.parse_args()
    runs = [measure_once(n_engines=args.n) for _ in range(args.repeats)]
    keys = ("ready_s", "first_all_reduce_s", "stop_s")
    summary = {k: dict(median=statistics.median(r[k] for r in runs), min=min(r[k] for r in runs),
                       max=max(r[k] for r in runs)) for k in keys}
    print(f"cluster.start({args.n}) x {args.repeats}, backend {runs[0]['backend']}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'metric':<20}{'median':>10}{'min':>10}{'max':>10}")
    for k in keys:
        print(f"{k:<20}{summary[k]['median']:>10.2f}{summary[k]['min']:>10.2f}{summary[k]['max']:>10.2f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(n_engines=args.n, repeats=args.repeats, cpus=os.cpu_count(), host=platform.node(),
                       summary=summary, runs=runs), f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
