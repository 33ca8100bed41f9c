"""HF -> Megatron (DDP | Megatron-FSDP) -> HF round trip: logits parity, exact export, export
throughput, one training step, FSDP-vs-DDP export equality, save_hf + reload.

    torchrun --nproc_per_node 2 bench/roundtrip.py --size m --dtype bf16 --out runs/bench/roundtrip.json
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/roundtrip.py --size xs --dtype fp32

The chain itself is `mfsdp_kit.perf.roundtrip.roundtrip` (also the body of tests/models/test_hf.py);
this script runs it for DDP and FSDP and compares their exports after the step.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from mfsdp_kit.perf.roundtrip import roundtrip
from mfsdp_kit.perf.report import write_json


def _fmt(value) -> str:
    return f"{value:.3e}" if isinstance(value, float) else str(value)


def main() -> None:
    from safetensors.torch import load_file
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    ap.add_argument("--size", default="m" if gpu else "xs")
    ap.add_argument("--arch", default="qwen2")
    ap.add_argument("--dtype", default="bf16" if gpu else "fp32")
    ap.add_argument("--workdir", default="/tmp/mfsdp_roundtrip")
    ap.add_argument("--out", default="runs/bench/roundtrip.json")
    args = ap.parse_args()
    runs = {mode: roundtrip(arch=args.arch, size=args.size, tp=1, fsdp=mode == "fsdp", dtype=args.dtype,
                            workdir=args.workdir) for mode in ("ddp", "fsdp")}
    if dist.get_rank() != 0:
        return
    a, b = load_file(runs["ddp"]["exported_file"]), load_file(runs["fsdp"]["exported_file"])
    fsdp_vs_ddp = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    print(f"\nround trip, {args.arch} {args.size}, {args.dtype}, world {dist.get_world_size()}")
    keys = ["logits_maxdiff", "export_maxdiff", "export_names_match", "changed_by_step",
            "reload_vs_megatron_maxdiff", "export_bytes", "export_s", "export_gbps"]
    print(f"{'':28}{'DDP':>16}{'FSDP':>16}")
    for k in keys:
        print(f"{k:<28}" + "".join(f"{_fmt(runs[m][k]):>16}" for m in ("ddp", "fsdp")))
    print(f"FSDP vs DDP export after one step: max|diff| {fsdp_vs_ddp:.3e}")
    write_json(args.out, dict(args=vars(args), runs=runs, fsdp_vs_ddp_after_step=fsdp_vs_ddp))


if __name__ == "__main__":
    main()
