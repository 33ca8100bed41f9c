"""The decode step's GEMMs at small batch: cuBLAS (`F.linear`, what the engine runs) against the kit's skinny Triton
GEMM (`rl.rollout.gemm`) over every config of `gemm.CONFIGS`, per weight shape and rows, beside the floor.

    python bench/decode_gemm.py --out runs/bench/decode_gemm.json   # 1 GPU

Shapes: tiny `l`'s layer (q/k/v, o, gate/up, down; 1.70 B in 28 layers) and the Qwen2.5-7B shape's. Microseconds
per GEMM are the mean of the calls recorded in one CUDA graph, replayed 5 times, each call on the next of enough
weight copies (>= 256 MB in all) that none is in L2 when read, as in a decode step. Floor: the weight's bytes at the
datasheet's bandwidth; the device-to-device copy rate is printed beside it (what a kernel can reach). A Triton
config with splits writes fp32 partial sums that the next kernel reads: "eff us" adds that read at the datasheet's
bandwidth, and the configs are ranked by it.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from mfsdp_kit.models import triton_launch
from mfsdp_kit.perf.report import write_json
from mfsdp_kit.rl.rollout import gemm

SHAPES = {"l": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
          "qwen2.5-7b": {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}}
"""Per model, its layer's weights [N, K]."""
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}
"""Datasheet HBM bytes/s by device name."""


def graphed_us(fn, *, calls: int, replays: int = 5) -> float:
    """Mean microseconds of `fn(i)` for i in range(calls), recorded in one CUDA graph, replayed `replays` times."""
    for i in range(calls):   # warm-up outside the capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (calls * replays) * 1e6


def copy_rate() -> float:
    """Bytes/s a 1 GiB device-to-device copy moves (read + write)."""
    a, b = (torch.empty(2 ** 29, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    us = graphed_us(lambda i: b.copy_(a), calls=4)
    return 2 * a.nbytes / (us * 1e-6)


def matmul_rate() -> float:
    """bf16 FLOP/s of torch.matmul at 8192^3 (what `perf.floors.Hardware.matmul_flops` records)."""
    a, b = (torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    us = graphed_us(lambda i: a @ b, calls=4)
    return 2 * 8192 ** 3 / (us * 1e-6)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="l,qwen2.5-7b")
    p.add_argument("--rows", default="16,32,64,128")
    p.add_argument("--out", default="runs/bench/decode_gemm.json")
    args = p.parse_args()
    name = torch.cuda.get_device_name()
    bw = next((v for k, v in BANDWIDTH.items() if k in name), BANDWIDTH["H200"])
    copy, mm = copy_rate(), matmul_rate()
    print(f"{name}: datasheet {bw / 1e12:.2f} TB/s, copy {copy / 1e12:.2f} TB/s, matmul 8192^3 {mm / 1e12:.0f} TFLOP/s")
    gen = torch.Generator(device="cuda").manual_seed(0)
    ms = [int(m) for m in args.rows.split(",")]
    cases = []
    for model in args.models.split(","):
        for label, (n, k) in SHAPES[model].items():
            nbytes = n * k * 2
            copies = min(32, max(2, -(-256 * 2 ** 20 // nbytes)))
            ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda", generator=gen) / k ** 0.5
                  for _ in range(copies)]
            cases.append((model, label, n, k, ws))
    xs = {(m, k): torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen) for m in ms
          for k in {c[3] for c in cases}}
    t0 = time.perf_counter()
    with triton_launch.ahead() as launches:   # every config's compile at once, on a thread per core
        for _, _, _, k, ws in cases:
            for m in ms:
                for cfg in gemm.CONFIGS:
                    if cfg.fits(k=k, rows=m):
                        gemm.skinny(xs[(m, k)], ws[0], cfg)
    try:
        triton_launch.compile_all(launches, device=torch.device("cuda"))
    except Exception as e:   # a config the device cannot load fails again, alone, at its warm-up below
        print(f"compile_all: {type(e).__name__}: {str(e)[:200]}")
    print(f"compiled {len(launches)} launches in {time.perf_counter() - t0:.1f} s")
    print(f"{'model':>10} {'weight':>8} {'rows':>5} {'MB':>6} {'floor us':>8} {'cublas us':>9} {'%bw':>4} "
          f"{'triton us':>9} {'eff us':>7} {'%bw':>4} {'speedup':>7}  config")
    rows = []
    for model, label, n, k, ws in cases:
        floor = n * k * 2 / bw * 1e6
        for m in ms:
            x = xs[(m, k)]
            calls = len(ws) * max(1, 24 // len(ws))
            want = F.linear(x, ws[0]).float()
            cublas = graphed_us(lambda i: F.linear(x, ws[i % len(ws)]), calls=calls)
            tried = []
            for cfg in gemm.CONFIGS:
                if not cfg.fits(k=k, rows=m):
                    continue
                try:
                    us = graphed_us(lambda i: gemm.skinny(x, ws[i % len(ws)], cfg), calls=calls)
                    got = gemm.skinny(x, ws[0], cfg).float()
                except Exception as e:   # a config the device cannot run: noted, not fatal
                    print(f"  {label} rows {m} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                got = got.sum(0) if cfg.splits > 1 else got
                partial_read = (cfg.splits * m * n * 4 / bw * 1e6) if cfg.splits > 1 else 0.0
                err = ((got - want).abs().max() / want.abs().max()).item()
                tried.append(dict(config=vars(cfg), us=us, eff_us=us + partial_read, rel_err=err))
            tried.sort(key=lambda r: r["eff_us"])
            best = tried[0]
            rows.append(dict(model=model, weight=label, n=n, k=k, rows=m, bytes=n * k * 2, floor_us=floor,
                             cublas_us=cublas, best=best, top=tried[:6]))
            c = best["config"]
            print(f"{model:>10} {label:>8} {m:>5} {n * k * 2 / 1e6:>6.1f} {floor:>8.1f} {cublas:>9.1f} "
                  f"{100 * floor / cublas:>3.0f}% {best['us']:>9.1f} {best['eff_us']:>7.1f} "
                  f"{100 * floor / best['eff_us']:>3.0f}% {cublas / best['eff_us']:>6.2f}x  "
                  f"n{c['block_n']} k{c['block_k']} s{c['splits']} st{c['stages']} err {best['rel_err']:.1e}")
    write_json(args.out, dict(args=vars(args), device=name, datasheet_bytes_per_s=bw, copy_bytes_per_s=copy,
                              matmul_flops=mm, rows=rows))


if __name__ == "__main__":
    main()
