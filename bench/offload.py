"""Offload/reload of the Megatron-FSDP model state: device memory freed, seconds, GB/s.

    torchrun --nproc_per_node 2 bench/offload.py --size l --out runs/bench/offload.json          # GPU, bf16, 1.7 B
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/offload.py --size xs                     # CPU, fp32

After one training step (so Adam's states exist), `offload.offload` moves this rank's shards
(model weights, fp32 main weights, main grads, exp_avg, exp_avg_sq) to pinned host memory and
`offload.reload` brings them back. Reported per rank: allocated bytes before / after offload
(target after < 5 % of the model-state bytes), seconds and GB/s each way (median of --repeats),
a plain pinned copy of the same bytes host->device and device->host in the same run (the
ceiling), and the peak allocated during a GRPO-like rollout phase (refresh a rollout HF model,
sample): allocated when sampling starts and the peak while it samples, with and without
offload. Also: every shard bitwise after the cycles, and the losses of a few steps run twice
from one state (restored from a host snapshot), plainly and with offload + reload before every
step (same batches: must be identical, bf16 on GPU too). On CPU allocator numbers are 0 and
"host->device" is a host->host copy: the run checks the code path, not the numbers.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from mfsdp_kit.train import data
from mfsdp_kit.distributed import engine, offload, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.distributed.introspect import torch_dtype
from mfsdp_kit.distributed.memory import memory_report
from mfsdp_kit.models import hf as hf_models
from mfsdp_kit.models.tiny import tiny
from mfsdp_kit.train import step
from mfsdp_kit.distributed import clock
from mfsdp_kit.perf.report import write_json


def _allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def _timed(fn) -> float:
    dist.barrier()
    return clock.seconds(fn)[0]


def plain_copy_gb_per_s(nbytes: int, device, repeats: int) -> dict:
    """Host->device and device->host GB/s of one pinned tensor of `nbytes` (the ceiling)."""
    pin = torch.cuda.is_available()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = statistics.median(_timed(lambda: dev.copy_(host, non_blocking=True)) for _ in range(repeats))
    d2h = statistics.median(_timed(lambda: host.copy_(dev, non_blocking=True)) for _ in range(repeats))
    return dict(h2d_gb_per_s=nbytes / h2d / 1e9, d2h_gb_per_s=nbytes / d2h / 1e9)


def rollout_memory(model, opt, rollout, *, with_offload: bool, prompts) -> dict:
    """GRPO's rollout phase (refresh the rollout model, [offload], sample): bytes allocated when
    sampling starts and the peak while it samples, i.e. what the rollout leaves free."""
    rollout.refresh(model.chunks, model.bridge)
    if with_offload:
        offload.offload(model.chunks, opt)
    clock.synchronize()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = _allocated()
    rollout.sample(prompts, n=4, max_new_tokens=16, temperature=1.0, top_p=1.0, seed=0)
    clock.synchronize()
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    if with_offload:
        offload.reload(model.chunks, opt)
    return dict(allocated_at_start=start, peak=peak)


def _snapshot(chunks, opt) -> dict:
    """Host copies of every shard (params, main weights, grads, Adam states): no device memory."""
    return {k: [t.detach().to("cpu", copy=True) for t in ts] for k, ts in offload.shard_tensors(chunks, opt).items()}


@torch.no_grad()
def _restore(chunks, opt, snapshot: dict) -> None:
    for k, ts in offload.shard_tensors(chunks, opt).items():
        for t, saved in zip(ts, snapshot[k]):
            t.copy_(saved)


def losses_with_and_without_offload(model, opt, batches) -> dict:
    """Losses of len(batches) steps from one state twice: plainly, then (state restored bitwise from
    a snapshot) with offload + reload before every step. Same batches: must be identical."""
    snapshot = _snapshot(model.chunks, opt)
    plain = [step(model.chunks, opt, b, micro_batch_size=8).loss for b in batches]
    _restore(model.chunks, opt, snapshot)
    cycled = []
    for b in batches:
        offload.offload(model.chunks, opt)
        offload.reload(model.chunks, opt)
        cycled.append(step(model.chunks, opt, b, micro_batch_size=8).loss)
    return dict(plain=plain, offloaded=cycled, identical=plain == cycled)


def main() -> None:
    on_gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="m" if on_gpu else "xs", help="models.tiny size: xs | s | m | l (1.7 B)")
    ap.add_argument("--arch", default="qwen2", help="models.tiny arch: qwen2 | llama")
    ap.add_argument("--dtype", default="bf16" if on_gpu else "fp32", choices=["bf16", "fp32"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--twin-steps", type=int, default=4, help="steps of the offloaded-vs-plain loss comparison")
    ap.add_argument("--workdir", default="runs/bench/offload_models")
    ap.add_argument("--out", default="runs/bench/offload.json")
    args = ap.parse_args()
    cfg = EngineConfig(use_megatron_fsdp=True, dtype=args.dtype)
    rt = runtime.init(cfg)
    path = Path(args.workdir) / f"{args.arch}-{args.size}"
    if rt.rank == 0:
        tiny(path, arch=args.arch, size=args.size)
    dist.barrier()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = hf_models.load(path, cfg)
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-4), cfg)
    batches = list(itertools.islice(data.batches(data.ArithmeticTask(digits=1).train_pairs(90), tok, seq_len_tokens=16,
                                                 global_batch=8 * dist.get_world_size()), args.twin_steps))
    batch = batches[0]
    step(model.chunks, opt, batch, micro_batch_size=8)  # Adam's states exist from here on
    model_state = memory_report(model.chunks, opt).model_state_bytes

    resident = _snapshot(model.chunks, opt)
    offload_s, reload_s, before, after, nbytes = [], [], 0, 0, 0
    for _ in range(args.repeats):
        engine.synchronize_fsdp_params(model.chunks)  # measure shards, not all-gathered buckets
        clock.synchronize()
        before = _allocated()
        stats = {}
        offload_s.append(_timed(lambda: stats.update(offload.offload(model.chunks, opt))))
        after, nbytes = _allocated(), stats["bytes"]
        reload_s.append(_timed(lambda: offload.reload(model.chunks, opt)))
    plain = plain_copy_gb_per_s(nbytes, rt.device, args.repeats)
    bitwise = all(torch.equal(a, b) for k, ts in _snapshot(model.chunks, opt).items() for a, b in zip(ts, resident[k]))
    del resident
    twin = losses_with_and_without_offload(model, opt, batches[1:])

    rollout = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(args.dtype)).to(rt.device)
    from mfsdp_kit.rl.grpo import Rollout
    rollout = Rollout(rollout, tok)
    prompts = [p for p, _ in data.ArithmeticTask(digits=1).rl_prompts(8)]
    mem = {flag: rollout_memory(model, opt, rollout, with_offload=flag, prompts=prompts) for flag in (False, True)}
    step(model.chunks, opt, batch, micro_batch_size=8)  # training still works after the cycles

    r = dict(wrapper=type(model.chunks[0]).__name__, model_state_bytes=model_state, offload_bytes=nbytes,
             bytes_by_kind=stats["bytes_by_kind"], allocated_before=before, allocated_after=after,
             after_over_model_state=after / model_state, offload_s=statistics.median(offload_s),
             reload_s=statistics.median(reload_s), offload_s_all=offload_s, reload_s_all=reload_s,
             rollout_no_offload=mem[False], rollout_offload=mem[True], bitwise_after_reload=bitwise,
             twin_losses=twin, **plain)
    r["offload_gb_per_s"] = nbytes / r["offload_s"] / 1e9
    r["reload_gb_per_s"] = nbytes / r["reload_s"] / 1e9
    if rt.rank == 0:
        mib = 2 ** 20
        print(f"\noffload/reload of Megatron-FSDP state, {args.arch}-{args.size} ({args.dtype}), world "
              f"{dist.get_world_size()}, rank 0, median of {args.repeats}, device {rt.device}")
        rows = [("model-state bytes (memory_report)", f"{model_state / mib:.2f} MiB"),
                ("offloaded bytes", f"{nbytes / mib:.2f} MiB  {stats['bytes_by_kind']}"),
                ("allocated before / after offload", f"{before / mib:.2f} / {after / mib:.2f} MiB "
                                                     f"({100 * r['after_over_model_state']:.2f} % of model state)"),
                ("offload  s | GB/s", f"{r['offload_s']:.4f} | {r['offload_gb_per_s']:.2f}"),
                ("reload   s | GB/s", f"{r['reload_s']:.4f} | {r['reload_gb_per_s']:.2f}"),
                ("plain pinned copy H2D | D2H GB/s", f"{plain['h2d_gb_per_s']:.2f} | {plain['d2h_gb_per_s']:.2f}"),
                *[(f"rollout {'with' if flag else 'without'} offload: allocated / peak",
                   f"{m['allocated_at_start'] / mib:.2f} / {m['peak'] / mib:.2f} MiB") for flag, m in mem.items()],
                (f"every shard bitwise after {args.repeats} cycles", str(bitwise)),
                ("losses offloaded vs plain (same state)", f"identical={twin['identical']} "
                                                          f"{twin['offloaded']} vs {twin['plain']}")]
        for name, value in rows:
            print(f"  {name:<42}{value}")
        write_json(args.out, dict(args=vars(args), world=dist.get_world_size(), result=r))
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
