"""Decode attention, one query a row: SDPA over the masked slot bucket (cuDNN's kernel for grouped heads on a GPU)
against the kit's Triton kernels (`rl.rollout.kernels.attention`), per (rows, slot bucket), beside the floor.

    python bench/decode_attention.py --out runs/bench/decode_attention.json   # 1 GPU

SDPA reads the bucket under a mask; the kernels are given the whole cache's slots, as the engine calls them (their
splits share out each row's own keys). Each row's position is drawn uniformly below the bucket (a GRPO batch's rows are of many lengths). Microseconds per
call are the mean of 20 calls recorded in one CUDA graph, replayed 10 times (how the engine runs them); "first ms"
is the first call of a new shape (cuDNN builds a plan per shape; the kernels compile once per head size and group).
Floor: the K and V bytes the rows' positions need (each KV head read once) at the device's memory bandwidth.
Shape: tiny `l` / qwen2-1.8b's attention (16 query heads, 4 KV heads, head size 128), bf16.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from mfsdp_kit.perf import floors
from mfsdp_kit.perf.report import write_json
from mfsdp_kit.rl.rollout.kernels.attention import decode_attention
from mfsdp_kit.rl.rollout.decoder import masks


def graphed_us(fn, *, calls: int = 20, replays: int = 10) -> float:
    """Mean microseconds of one `fn()` over `calls` recorded in one CUDA graph, replayed `replays` times."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (calls * replays) * 1e6


def first_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="16x64,16x256,32x192,64x256,128x384,256x128,512x128,512x320,512x576",
                   help="rows x slot bucket, comma-separated")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default="runs/bench/decode_attention.json")
    args = p.parse_args()
    hw = floors.hardware() or floors.HARDWARE["H200"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    rows_max, slots_max = max(b for b, _ in shapes), max(s for _, s in shapes)
    k, v = (torch.randn(rows_max, args.kv_heads, slots_max, args.head_dim, device="cuda", dtype=torch.bfloat16,
                        generator=gen) for _ in range(2))
    scale = args.head_dim ** -0.5
    print(f"decode attention, {args.heads} query / {args.kv_heads} KV heads of {args.head_dim}, bf16; us a call "
          f"(first call of the shape, ms); floor at {hw.memory_bytes_per_s / 1e12:.1f} TB/s")
    print(f"{'rows x slots':>12} {'sdpa us':>9} {'kernels us':>10} {'floor us':>9} {'speedup':>8} "
          f"{'sdpa 1st':>9} {'kern 1st':>9} {'max |diff|':>10}")
    rows = []
    for b, slots in shapes:
        q = torch.randn(b, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        pos = torch.randint(0, slots, (b,), device="cuda", generator=gen)
        bias = masks(pos, slots=slots, windows=[None], dtype=q.dtype)[None]

        def sdpa():
            return F.scaled_dot_product_attention(q[:, :, None], k[:b, :, :slots], v[:b, :, :slots], attn_mask=bias,
                                                  enable_gqa=True, scale=scale)[:, :, 0]

        def kernels():   # given the whole cache's slots, as the engine does (one graph per batch bucket)
            return decode_attention(q, k, v, pos, slots=slots_max, window=None, scale=scale)
        first = dict(sdpa=first_ms(sdpa), kernels=first_ms(kernels))
        us = dict(sdpa=graphed_us(sdpa), kernels=graphed_us(kernels))
        diff = (sdpa().float() - kernels().float()).abs().max().item()
        kv_bytes = int((pos + 1).sum()) * args.kv_heads * args.head_dim * 2 * k.element_size()
        floor_us = kv_bytes / hw.memory_bytes_per_s * 1e6
        rows.append(dict(rows=b, slots=slots, us=us, first_ms=first, floor_us=floor_us, kv_bytes=kv_bytes,
                         max_abs_diff=diff))
        print(f"{f'{b} x {slots}':>12} {us['sdpa']:>9.1f} {us['kernels']:>10.1f} {floor_us:>9.1f} "
              f"{us['sdpa'] / us['kernels']:>7.2f}x {first['sdpa']:>9.1f} {first['kernels']:>9.1f} {diff:>10.4f}")
    write_json(args.out, dict(args=vars(args), hardware=hw.name, rows=rows))


if __name__ == "__main__":
    main()
