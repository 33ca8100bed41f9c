"""Tokens/s at a memory cap: from throughput runs (bench/throughput.py JSONs) of ddp, fsdp and
fsdp2 at several micro-batch / recompute settings, the best tokens/s per GPU each system reaches
with its measured peak (torch's max allocated, whole run) at or under each cap.

    python bench/memory_cap.py --caps 40 80 --out runs/gpu/memory_cap.json runs/gpu/headline.json runs/gpu/memcap_*.json

A setting counts for a cap when its peak fits; torch's reserved memory (the allocator's cache and
fragments) comes on top, so a cap is a budget for allocated bytes, not the GPU's size.
"""
from __future__ import annotations

import argparse

from mfsdp_kit.perf.capacity import best_under, candidates
from mfsdp_kit.perf.report import write_json
from mfsdp_kit.perf.variants import TRAINERS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="bench/throughput.py JSON files")
    ap.add_argument("--caps", type=float, nargs="+", default=[40.0, 80.0], help="GiB per GPU")
    ap.add_argument("--out", default="runs/bench/memory_cap.json")
    args = ap.parse_args()
    rows = candidates(args.paths)
    print(f"{'system':<8}{'mb':>4}{'recompute':>11}{'k tokens/s':>12}{'MFU %':>8}{'peak GiB':>10}  file")
    for r in sorted(rows, key=lambda r: (r["system"], r["recompute"], r["micro_batch_size"])):
        print(f"{r['system']:<8}{r['micro_batch_size']:>4}{r['recompute']:>11}{r['tokens_per_s_per_gpu'] / 1e3:>12.1f}"
              f"{100 * r['mfu']:>8.1f}{r['peak_gib']:>10.2f}  {r['file']}")
    table = {}
    for cap in args.caps:
        table[cap] = best_under(rows, cap)
        cells = [f"{b['tokens_per_s_per_gpu'] / 1e3:.1f}k (mb {b['micro_batch_size']}, {b['recompute']}, "
                 f"{b['peak_gib']:.1f} GiB)" if b else "nothing fits" for b in table[cap].values()]
        print(f"cap {cap:g} GiB: " + " | ".join(f"{s}: {c}" for s, c in zip(TRAINERS, cells)))
    write_json(args.out, dict(rows=rows, caps={str(c): t for c, t in table.items()}))


if __name__ == "__main__":
    main()
