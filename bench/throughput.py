"""Throughput, MFU and memory per GPU: megatron DDP vs Megatron-FSDP vs PyTorch FSDP2, one run.

    torchrun --nproc_per_node 2 bench/throughput.py --spec 1.7b --attention sdpa \\
        --micro-batch-size 4 --global-batch 16 --steps 8 --warmup 2 --out runs/bench/throughput.json
    torchrun --nproc_per_node 2 bench/throughput.py --spec 1.7b --attention sdpa --profile \\
        --modes ddp,fsdp,fsdp2,fsdp-no-overlap,fsdp-unit2x,fsdp-recompute,fsdp-optoffload
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/throughput.py --spec tiny --steps 3   # CPU

All modes train the SAME megatron GPT (local spec, same attention backend, seed, batches):
- ddp:   megatron DistributedDataParallel + distributed optimizer (ZeRO-1), bf16 Float16Module;
- fsdp:  Megatron-FSDP, optim_grads_params (ZeRO-3) + `--fsdp-overrides`;
- fsdp2: torch `fully_shard` per TransformerLayer then the root, MixedPrecisionPolicy(bf16
         params, fp32 reduce), torch AdamW (fused on GPU) on the fp32 sharded params.
Named variants change one knob of `fsdp` (VARIANTS below), so each knob is measured in the same
run as its baseline: fsdp-no-overlap, fsdp-unit2x, fsdp-unit-min, fsdp-recompute, fsdp-optoffload,
fsdp-unfused (with --fused-kernels: the same model without them).
Each mode runs in turn in the same processes; memory is freed between modes and an OOM (or
any error) is recorded for that mode and the next one runs.

FLOPs per token (MFU, not HFU: recompute is not counted), PaLM's accounting:
    6 * N  +  12 * L * H * S
    N = parameters that take part in a matmul = transformer layers + final norm + output
        layer (H * V); the input embedding table is a lookup and is EXCLUDED.
    12 * L * H * S = attention scores and weighted sum (2 matmuls * 2 FLOP * S * H per token
        per layer, x3 for forward + backward), full S x S (causal masking not discounted).
    MFU = tokens/s/GPU * FLOPs per token / 989e12 (H100/H200 dense bf16 peak).

--profile: after the timed steps, 2 more steps of ddp / fsdp / fsdp2 (--profile-modes) run under
torch.profiler; rank 0 writes a chrome trace next to --out (<out>.<mode>.trace.json.gz, open it in
ui.perfetto.dev) and reads its GPU timeline back: per step, the time of compute kernels and of NCCL
kernels (sums), the NCCL time NOT hidden behind compute (exposed: |U(nccl)| - |U(nccl) n U(compute)|,
U = union of kernel intervals over all streams), the GPU idle time (step wall time - |U(every
kernel, memcpy, memset)|) and the 10 kernels that took longest. The profiled steps carry the
profiler's own overhead: compare their shares, not their wall time, with the timed steps.
"""
from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import statistics
import sys
import time
import traceback
from collections import namedtuple
from dataclasses import replace

import torch
import torch.distributed as dist

from mfsdp_kit import engine, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.data import random_token_batches
from mfsdp_kit.memory import memory_report, zero_formula_bytes
from mfsdp_kit.models import GPTSpec, gpt_model_fn
from mfsdp_kit.train import Batch, step

PEAK_FLOPS_PER_GPU = 989e12  # H100/H200 SXM, dense bf16
SPECS = {
    "tiny": GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                    vocab_size=128, seq_len_tokens=32),
    # 24 * (4 * 2048^2 + 3 * 2048 * 5632) = 1.23 B in layers + 2 * 32768 * 2048 = 0.13 B embeddings
    "1.7b": GPTSpec(num_layers=24, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632,
                    vocab_size=32768, seq_len_tokens=2048),
    # 26 * (4 * 3072^2 + 3 * 3072 * 8192) = 2.94 B + 0.20 B embeddings
    "3b": GPTSpec(num_layers=26, hidden_size=3072, num_attention_heads=24, ffn_hidden_size=8192,
                  vocab_size=32768, seq_len_tokens=2048),
    # Llama-2-7B shape: 32 * (4 * 4096^2 + 3 * 4096 * 11008) = 6.48 B + 0.27 B embeddings
    "7b": GPTSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                  vocab_size=32768, seq_len_tokens=2048),
}
TRAINERS = ("ddp", "fsdp", "fsdp2")
PROFILE_STEPS = 2


def megatron_default_unit_elements(spec: GPTSpec) -> int:
    """What Megatron-FSDP uses when `suggested_communication_unit_size` is None (megatron-core
    0.16.1, megatron_fsdp.py, MegatronFSDP.__init__): twice the mean elements of an FSDP unit
    (a TransformerLayer), then `max(1e9, ...)` - commented "Cap to 1B elements" but a floor
    (upstream fixes it to `min`: NVIDIA/Megatron-LM PR #7134), so it is 1e9 elements for every
    spec here (a 7b layer is 0.2e9). Megatron then prefetches all-gathers up to unit // 2
    elements ahead of the running layer (5e8 = 1 GB of bf16 weights, ~10 layers of 1.7b) and
    lets up to unit elements of gradient reduce-scatters queue before it waits."""
    return max(1_000_000_000, 2 * layer_params(spec))


def layer_params(spec: GPTSpec) -> int:
    """Parameters of one transformer layer (= one Megatron-FSDP unit)."""
    return (spec.param_count() - replace(spec, num_layers=0).param_count()) // spec.num_layers


# name -> (trainer, EngineConfig overrides, or a function of the spec returning them).
# override_ddp_config entries are merged into --fsdp-overrides / --ddp-overrides, not replacing them.
VARIANTS = {
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {}),
    "fsdp2": ("fsdp2", {}),
    # How much does overlap buy? The two flags alone change nothing: MegatronFSDP.__init__ sets
    # both back to True for optim_grads_params (megatron_fsdp.py:274-279, megatron-core 0.16.1).
    # What does stop the overlap is a unit of 1 element: no all-gather prefetch (each layer's
    # all-gather starts when the layer needs it) and a reduce-scatter queue of 1 element (each
    # reduce-scatter waits for the previous one before backward goes on).
    "fsdp-no-overlap": ("fsdp", dict(override_ddp_config=dict(
        overlap_param_gather=False, overlap_grad_reduce=False, suggested_communication_unit_size=1))),
    # twice the prefetch depth and reduce-scatter queue: more memory, fewer waits?
    "fsdp-unit2x": ("fsdp", lambda spec: dict(override_ddp_config=dict(
        suggested_communication_unit_size=2 * megatron_default_unit_elements(spec)))),
    # what the fixed `min` would pick: 2 x the mean layer, i.e. prefetch about one layer ahead
    "fsdp-unit-min": ("fsdp", lambda spec: dict(override_ddp_config=dict(
        suggested_communication_unit_size=min(1_000_000_000, 2 * layer_params(spec))))),
    # "full", not "selective": selective recomputes core attention only, and SDPA already keeps
    # no S x S scores, so it would cost time and save nothing. Full recomputes each layer's
    # forward in backward (+1 forward, ~+33 % FLOPs) and keeps only layer inputs.
    "fsdp-recompute": ("fsdp", dict(recompute="full")),
    # issue 10: Adam moments + fp32 main weights (12 B/param / N) on the host between steps
    "fsdp-optoffload": ("fsdp", dict(optimizer_offload=True)),
    # the effect of --fused-kernels in the same run (megatron's unfused RoPE and SwiGLU)
    "fsdp-unfused": ("fsdp", dict(fused_kernels=False)),
}


def matmul_params(spec: GPTSpec) -> int:
    """N of the FLOP formula: every parameter except the input embedding table."""
    return spec.param_count() - spec.vocab_size * spec.hidden_size


def flops_per_token(spec: GPTSpec) -> int:
    return 6 * matmul_params(spec) + 12 * spec.num_layers * spec.hidden_size * spec.seq_len_tokens


def batches(spec: GPTSpec, *, n: int, global_batch: int, seed: int = 0) -> list[Batch]:
    return random_token_batches(steps=n, global_batch=global_batch, seq_len_tokens=spec.seq_len_tokens,
                                vocab_size=spec.vocab_size, seed=seed)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    """Free every model built so far (call it only between models), then the allocator's cache;
    reset the peak statistics.

    A dropped Megatron-FSDP model is NOT freed by megatron-core 0.16.1 on its own, so without
    this each fsdp mode kept its memory and inflated the peaks of the modes after it:
    - RotaryEmbedding.forward is a functools.lru_cache (models/common/embeddings/
      rotary_pos_embedding.py:177) whose keys hold the module, and the state-dict hooks that
      Megatron-FSDP puts on every submodule hold the wrapper;
    - each parameter's post-accumulate-grad hook (megatron_fsdp.py, `_register_fsdp_hooks`)
      closes over the wrapper, a cycle through C++ that gc cannot collect;
    - Megatron-FSDP's module-level buffer pool (megatron_fsdp/utils.py, fsdp_double_buffer).
    `engine.release` undoes the first two for every MegatronFSDP gc still sees (also one whose
    wrapper failed to build, e.g. in an OOM trial of bench/max_model.py); the pool is reset here."""
    fsdp = sys.modules.get("megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp")
    engine.release([] if fsdp is None else  # type(): no __getattr__ on odd objects
                   [obj for obj in gc.get_objects() if issubclass(type(obj), fsdp.MegatronFSDP)])
    fsdp_utils = sys.modules.get("megatron.core.distributed.fsdp.src.megatron_fsdp.utils")
    if fsdp_utils is not None:
        fsdp_utils._GLOBAL_MEMORY_BUFFER = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def variant_overrides(mode: str, spec: GPTSpec) -> dict:
    overrides = VARIANTS[mode][1]
    return dict(overrides(spec) if callable(overrides) else overrides)


def engine_config(args, mode: str, spec: GPTSpec) -> EngineConfig:
    """The EngineConfig of `mode`: the command line's settings, then the variant's overrides."""
    trainer = VARIANTS[mode][0]
    overrides = variant_overrides(mode, spec)
    ddp_overrides = json.loads(args.fsdp_overrides if trainer == "fsdp" else args.ddp_overrides)
    ddp_overrides.update(overrides.pop("override_ddp_config", {}))
    on_gpu = torch.cuda.is_available()
    fields = dict(
        use_megatron_fsdp=trainer == "fsdp", dtype=args.dtype, attention_backend=args.attention,
        recompute=args.recompute, fused_kernels=args.fused_kernels, seed=1234, override_ddp_config=ddp_overrides,
        # Initialise on the GPU: CPU init of billions of parameters takes minutes.
        override_transformer_config=dict(use_cpu_initialization=False) if on_gpu else {})
    return EngineConfig(**{**fields, **overrides})


# ---- trainers: build, then step / report memory / settle --------------------------------------
Trainer = namedtuple("Trainer", "step memory settle")
"""step(batch, step_index) -> loss of one global batch; memory() -> dict as memory.memory_report;
settle() waits for the communication a step may leave in flight (Megatron-FSDP's prefetched
all-gathers), so its handles are released now, not later by the garbage collector."""


class PhasePeaks:
    """Peak allocated bytes of the forward/backward phase and of the optimizer step, kept apart:
    `before_step()` ends a forward/backward, `after_step()` ends an optimizer step. It resets
    torch's peak counter at each boundary, so `overall()` is the bench's whole-run peak.
    record=False leaves the counter alone (bench/max_model.py reads torch's own peaks)."""

    def __init__(self, record: bool = True):
        self.record = record
        self.peaks = {"forward_backward": 0, "optimizer_step": 0}

    def _close(self, phase: str) -> None:
        if self.record and torch.cuda.is_available():
            self.peaks[phase] = max(self.peaks[phase], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    def before_step(self) -> None:
        self._close("forward_backward")

    def after_step(self) -> None:
        self._close("optimizer_step")

    def overall(self) -> int:
        current = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        return max(current, *self.peaks.values())


def _record_step_phases(opt, peaks: PhasePeaks) -> None:
    """Make `opt.step()` (called inside train.step) mark the phase boundaries around itself."""
    inner = opt.step

    def step_with_phases(*a, **kw):
        peaks.before_step()
        out = inner(*a, **kw)
        peaks.after_step()
        return out
    opt.step = step_with_phases


def build_megatron(cfg: EngineConfig, spec: GPTSpec, args, peaks: PhasePeaks) -> Trainer:
    """megatron DDP or Megatron-FSDP (as `cfg` says) and megatron's (distributed) Adam."""
    chunks = engine.build(cfg, gpt_model_fn(spec, cfg))
    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-4, clip_grad=1.0), cfg)
    _record_step_phases(opt, peaks)

    def train_step(batch: Batch, i: int) -> float:
        return step(chunks, opt, batch, micro_batch_size=args.micro_batch_size, step_index=i).loss
    def settle() -> None:
        engine.synchronize_fsdp_params(chunks)  # waits for and drops pending all-gathers
        engine.restore_fsdp_params(chunks)
    return Trainer(train_step, lambda: memory_report(chunks, opt).as_dict(), settle)


def build_fsdp2(cfg: EngineConfig, spec: GPTSpec, args, peaks: PhasePeaks) -> Trainer:
    """The same megatron GPT under torch's fully_shard, stepped by torch AdamW."""
    from megatron.core import tensor_parallel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    rt = runtime.current()
    model = gpt_model_fn(spec, cfg)(pre_process=True, post_process=True)
    for p in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    model = model.float().to(rt.device)  # fp32 master weights; FSDP2 casts to bf16 per unit
    compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.dtype]
    mesh = init_device_mesh(rt.device.type, (rt.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                            fused=rt.device.type == "cuda")

    def train_step(batch: Batch, i: int) -> float:
        opt.zero_grad(set_to_none=True)
        loss = _fsdp2_forward_backward(model, batch, args.micro_batch_size, rt)
        peaks.before_step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        peaks.after_step()
        return loss
    return Trainer(train_step, lambda: _fsdp2_memory(model, opt, spec), lambda: None)


def build_trainer(mode: str, cfg: EngineConfig, spec: GPTSpec, args, peaks: PhasePeaks | None = None) -> Trainer:
    """The Trainer of `mode`: megatron's (ddp, fsdp and its variants) or torch FSDP2's."""
    build = build_fsdp2 if VARIANTS[mode][0] == "fsdp2" else build_megatron
    return build(cfg, spec, args, peaks or PhasePeaks(record=False))


def _fsdp2_forward_backward(model, batch: Batch, micro_batch_size: int, rt) -> float:
    """Per-token mean over the global batch, as train.step: sum / global tokens, grads averaged
    over ranks by FSDP2, hence the * world_size."""
    n = batch.num_sequences // rt.world_size
    local = batch.slice(rt.rank * n, (rt.rank + 1) * n).to(rt.device)
    global_tokens = batch.loss_mask.sum().item()
    total = torch.zeros(2, dtype=torch.float64, device=rt.device)
    for i in range(0, n, micro_batch_size):
        mb = local.slice(i, i + micro_batch_size)
        pos = torch.arange(mb.tokens.shape[1], device=rt.device).unsqueeze(0).expand_as(mb.tokens)
        per_token = model(mb.tokens, pos, None, labels=mb.labels)
        loss_sum = (per_token.float() * mb.loss_mask).sum()
        (loss_sum * rt.world_size / global_tokens).backward()
        total += torch.stack([loss_sum.detach().double(), mb.loss_mask.sum().double()])
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def _fsdp2_memory(model, opt, spec: GPTSpec) -> dict:
    """The same fields as memory.memory_report: fp32 sharded params (= main weights), fp32 grads, moments."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    params = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    grads = sum(local(p.grad).numel() * local(p.grad).element_size() for p in model.parameters() if p.grad is not None)
    states = sum(local(v).numel() * local(v).element_size() for s in opt.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.numel() > 1)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    model_state = params + grads + states
    return dict(params_bytes=params, grads_bytes=grads, main_params_bytes=0, optimizer_states_bytes=states,
                activations_peak_bytes=max(peak - model_state, 0), num_params=spec.param_count(),
                dp_size=dist.get_world_size(), model_state_bytes=model_state)


# ---- GPU timeline: union / overlap of kernel intervals -----------------------------------------
GpuActivity = namedtuple("GpuActivity", "name kind start_us end_us")
"""One kernel, memcpy or memset of a trace; kind = "nccl" | "compute" | "memcpy"."""


def union(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint (start, end) intervals covering the same time as `intervals`."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def covered(intervals) -> float:
    """Time covered by at least one interval (overlaps counted once)."""
    return sum(end - start for start, end in union(intervals))


def intersection(a, b) -> list[tuple[float, float]]:
    """Time covered by both `a` and `b` (each may overlap itself), as disjoint intervals."""
    a, b, out, i, j = union(a), union(b), [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def exposed(comm, compute) -> float:
    """Time some communication runs while no compute does: |U(comm)| - |U(comm) n U(compute)|."""
    return covered(comm) - covered(intersection(comm, compute))


def gpu_activities(trace: dict) -> list[GpuActivity]:
    """Kernels, memcpys and memsets of a torch.profiler (kineto) chrome trace. NCCL kernels are
    named nccl* (ncclDevKernel_AllGather_RING_LL, ncclKernel_...); every other kernel is compute."""
    out = []
    for ev in trace.get("traceEvents", []):
        cat = str(ev.get("cat", "")).lower()
        if ev.get("ph") != "X" or cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        name = str(ev.get("name", ""))
        kind = "memcpy" if cat != "kernel" else "nccl" if name.lower().startswith("nccl") else "compute"
        start = float(ev["ts"])
        out.append(GpuActivity(name, kind, start, start + float(ev.get("dur", 0.0))))
    return out


def timeline_summary(acts: list[GpuActivity], *, wall_s: float, steps: int, top: int = 10) -> dict:
    """Seconds PER STEP of `steps` steps that took `wall_s` in all (trace times are in us)."""
    per_step = lambda us: us / 1e6 / steps  # noqa: E731
    spans = {k: [(a.start_us, a.end_us) for a in acts if a.kind == k] for k in ("compute", "nccl", "memcpy")}
    busy = covered([(a.start_us, a.end_us) for a in acts])
    by_name: dict[str, list] = {}
    for a in acts:
        entry = by_name.setdefault(a.name, [a.kind, 0, 0.0])
        entry[1] += 1
        entry[2] += a.end_us - a.start_us
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][2])[:top]
    step_s = wall_s / steps
    return dict(
        steps=steps, step_s=step_s, num_activities=len(acts),
        compute_kernel_s=per_step(sum(e - s for s, e in spans["compute"])),
        nccl_kernel_s=per_step(sum(e - s for s, e in spans["nccl"])),
        memcpy_s=per_step(sum(e - s for s, e in spans["memcpy"])),
        nccl_exposed_s=per_step(exposed(spans["nccl"], spans["compute"])),
        gpu_busy_s=per_step(busy), gpu_idle_s=max(step_s - per_step(busy), 0.0),
        top_kernels=[dict(name=n[:200], kind=k, calls=c, s_per_step=per_step(us)) for n, (k, c, us) in ranked])


def _read_trace(path: str) -> dict:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def profile_steps(trainer: Trainer, data: list[Batch], trace_path: str) -> dict:
    """Run PROFILE_STEPS steps under torch.profiler (CUDA kernels on GPU, CPU ops only on CPU);
    rank 0 exports the chrome trace to `trace_path` and summarises its GPU timeline.

    The steps settle INSIDE the profiled region: a communication handle created under the
    profiler and freed after it stopped crashed the process (gloo's async work keeps the
    profiler's thread-local state; seen as a segfault in gc, torch 2.13 CPU)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    _sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for i in range(PROFILE_STEPS):
            trainer.step(data[i % len(data)], i)
        trainer.settle()
        _sync()
        wall_s = time.perf_counter() - start
    if dist.get_rank() != 0:
        return dict(steps=PROFILE_STEPS, step_s=wall_s / PROFILE_STEPS)
    try:  # a trace we cannot write or read must not cost the mode its throughput numbers
        os.makedirs(os.path.dirname(trace_path) or ".", exist_ok=True)
        prof.export_chrome_trace(trace_path)
        summary = timeline_summary(gpu_activities(_read_trace(trace_path)), wall_s=wall_s, steps=PROFILE_STEPS)
    except Exception as e:  # noqa: BLE001
        return dict(steps=PROFILE_STEPS, step_s=wall_s / PROFILE_STEPS, error=f"{type(e).__name__}: {e}"[:300])
    return dict(summary, trace=trace_path, trace_bytes=os.path.getsize(trace_path))


def trace_path(out: str, mode: str) -> str:
    return f"{os.path.splitext(out)[0]}.{mode}.trace.json.gz"


# ---- one mode, guarded ----------------------------------------------------------------------
def _train(mode: str, cfg: EngineConfig, spec: GPTSpec, data: list[Batch], args, peaks: PhasePeaks) -> dict:
    """Build, time every step of `data`, report memory, optionally profile. The model lives in
    this frame only, so it is freed when this returns or its exception is handled."""
    trainer = build_trainer(mode, cfg, spec, args, peaks)
    times, losses = [], []
    for i, b in enumerate(data):
        _sync()
        t0 = time.perf_counter()
        losses.append(trainer.step(b, i))
        _sync()
        times.append(time.perf_counter() - t0)
    memory = trainer.memory()  # its activation peak: whole run, not since the last phase reset
    memory["activations_peak_bytes"] = max(peaks.overall() - memory["model_state_bytes"], 0)
    out = dict(times=times, losses=losses, memory=memory, phase_peaks=dict(peaks.peaks))
    if args.profile and mode in args.profile_modes:
        out["profile"] = profile_steps(trainer, data, trace_path(args.out, mode))
    trainer.settle()
    return out


def run_mode(mode: str, spec: GPTSpec, data: list[Batch], args) -> dict:
    cfg = engine_config(args, mode, spec)
    rt = runtime.init(cfg, timeout_s=args.timeout_s)
    free_memory()
    result, error, peaks = None, None, PhasePeaks()
    try:
        result = _train(mode, cfg, spec, data, args, peaks)
    except torch.OutOfMemoryError as e:
        error = f"OOM: {str(e).splitlines()[0]}"
    except Exception as e:  # noqa: BLE001 - a failing mode must not hide the others
        error = f"{type(e).__name__}: {str(e)[:500]}"
        if rt.rank == 0:
            traceback.print_exc()
    peak = peaks.overall()
    runtime.shutdown()
    free_memory()
    kind = VARIANTS[mode][0]
    variant = dict(trainer=kind, overrides=variant_overrides(mode, spec), config=cfg.to_dict())
    if error is not None:
        return dict(mode=mode, error=error, peak_bytes=peak, variant=variant)
    measured = result["times"][args.warmup:] or result["times"]
    step_s = statistics.median(measured)
    tokens_per_s_gpu = len(data[0].tokens) * spec.seq_len_tokens / step_s / rt.world_size
    mem = result["memory"]
    formula = zero_formula_bytes(num_params=spec.param_count(), dp_size=rt.dp_size, fsdp=kind != "ddp",
                                 dtype=args.dtype)
    return dict(mode=mode, variant=variant, step_s=step_s, step_times_s=result["times"], losses=result["losses"],
                tokens_per_s_per_gpu=tokens_per_s_gpu,
                mfu=tokens_per_s_gpu * flops_per_token(spec) / PEAK_FLOPS_PER_GPU,
                peak_bytes=peak, phase_peak_bytes=result["phase_peaks"], memory=mem, zero_formula_bytes=formula,
                model_state_vs_16_bytes_per_param=mem["model_state_bytes"] / (16 * spec.param_count() / rt.dp_size),
                **({"profile": result["profile"]} if "profile" in result else {}))


# ---- report --------------------------------------------------------------------------------
def _cell(r: dict, fmt) -> str:
    if "error" in r:
        return "-"
    try:
        return fmt(r)
    except (KeyError, TypeError, ZeroDivisionError):
        return "-"  # a row this mode has no value for (not profiled, no fsdp baseline)


def _row(name: str, results: dict, fmt) -> str:
    return f"{name:<30}" + "".join(f"{_cell(results[m], fmt):>16}" for m in results)


def print_report(results: dict, spec: GPTSpec, args, world: int) -> None:
    big = spec.param_count() > 1e8
    gib, unit = (2**30, "GiB") if big else (2**20, "MiB")
    scale, pu = (1e9, "B") if big else (1e6, "M")
    print(f"\n{args.spec}: {spec.param_count() / scale:.3f} {pu} params (N for FLOPs = {matmul_params(spec) / scale:.3f} {pu}, "
          f"input embedding excluded), L={spec.num_layers} H={spec.hidden_size} S={spec.seq_len_tokens}, "
          f"{args.dtype}, attention={args.attention}, recompute={args.recompute}, "
          f"fused_kernels={args.fused_kernels}, world={world}, "
          f"micro-batch {args.micro_batch_size}, global batch {args.global_batch} x {spec.seq_len_tokens} tokens")
    print(f"FLOPs/token = 6*N + 12*L*H*S = {flops_per_token(spec) / 1e9:.2f} GFLOP; "
          f"MFU peak {PEAK_FLOPS_PER_GPU / 1e12:.0f} TFLOP/s/GPU (bf16 dense H100/H200)")
    for m in results:
        if m not in TRAINERS:
            print(f"  {m} = {VARIANTS[m][0]} + {variant_overrides(m, spec)}")
    print(f"{'':<30}" + "".join(f"{m:>16}" for m in results))
    print(_row("step s (median)", results, lambda r: f"{r['step_s']:.4f}"))
    print(_row("tokens/s/GPU", results, lambda r: f"{r['tokens_per_s_per_gpu']:,.0f}"))
    print(_row("MFU %", results, lambda r: f"{100 * r['mfu']:.1f}"))
    print(_row(f"peak {unit}/GPU", results, lambda r: f"{r['peak_bytes'] / gib:.2f}"))
    for phase in ("forward_backward", "optimizer_step"):
        print(_row(f"  peak in {phase}", results, lambda r: f"{r['phase_peak_bytes'][phase] / gib:.2f}"))
    print(_row(f"model state {unit}/GPU", results, lambda r: f"{r['memory']['model_state_bytes'] / gib:.3f}"))
    print(_row("  / (16 B * params / dp)", results, lambda r: f"{r['model_state_vs_16_bytes_per_param']:.3f}"))
    print(_row(f"ZeRO formula {unit}/GPU", results, lambda r: f"{r['zero_formula_bytes'] / gib:.3f}"))
    base = results.get("fsdp", {})
    print(_row("tokens/s / fsdp", results, lambda r: f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.3f}"))
    print(_row(f"peak - fsdp {unit}", results, lambda r: f"{(r['peak_bytes'] - base['peak_bytes']) / gib:+.2f}"))
    print(_row("loss first -> last", results, lambda r: f"{r['losses'][0]:.3f}>{r['losses'][-1]:.3f}"))
    ref = next((r for r in results.values() if "error" not in r), None)
    if ref is not None:  # same seed, init and batches: the modes differ only by rounding
        print(_row(f"max|loss - {ref['mode']}|", results,
                   lambda r: f"{max(abs(a - b) for a, b in zip(r['losses'], ref['losses'])):.2e}"))
    if any("profile" in r for r in results.values()):
        print_profile(results)
    for m, r in results.items():
        if "error" in r:
            print(f"{m}: FAILED {r['error']}")
    print(f"\ntargets (issue 9 states them for the 1.7b spec on 2 GPUs; this run: {args.spec}, {world} GPU(s)):")
    for line in targets(results):
        print("  " + line)


def print_profile(results: dict) -> None:
    print(f"profiled ({PROFILE_STEPS} steps, rank 0, per step; exposed = NCCL time with no compute kernel running)")
    ms = lambda key: lambda r: f"{1e3 * r['profile'][key]:.1f}"  # noqa: E731
    pct = lambda key: lambda r: f"{100 * r['profile'][key] / r['profile']['step_s']:.1f}"  # noqa: E731
    print(_row("  step ms (under profiler)", results, ms("step_s")))
    print(_row("  compute kernels ms", results, ms("compute_kernel_s")))
    print(_row("  NCCL kernels ms", results, ms("nccl_kernel_s")))
    print(_row("  NCCL exposed ms", results, ms("nccl_exposed_s")))
    print(_row("  NCCL exposed % step", results, pct("nccl_exposed_s")))
    print(_row("  memcpy/memset ms", results, ms("memcpy_s")))
    print(_row("  GPU idle ms", results, ms("gpu_idle_s")))
    print(_row("  GPU idle % step", results, pct("gpu_idle_s")))
    for m, r in results.items():
        prof = r.get("profile") or {}
        if "error" in prof:
            print(f"{m}: trace analysis failed: {prof['error']}")
        if "trace" not in prof:
            continue
        if not prof["num_activities"]:
            print(f"{m}: no GPU activity in the trace (a CPU run, or CUPTI traced no kernels); trace {prof['trace']}")
            continue
        print(f"{m}: top kernels (ms/step, calls in {prof['steps']} steps); trace {prof['trace']} "
              f"({prof['trace_bytes'] / 2**20:.1f} MiB)")
        for k in prof["top_kernels"]:
            print(f"  {1e3 * k['s_per_step']:9.2f} {k['calls']:6d}x {k['kind']:<8} {k['name'][:110]}")


def targets(results: dict) -> list[str]:
    ok = lambda m: m in results and "error" not in results[m]  # noqa: E731
    lines = []
    if ok("fsdp"):
        f = results["fsdp"]
        lines.append(f"FSDP MFU {100 * f['mfu']:.1f} %  (target >= 50 %)  {'PASS' if f['mfu'] >= 0.5 else 'MISS'}")
        ratio = f["model_state_vs_16_bytes_per_param"]
        lines.append(f"FSDP model state / (16 B/param / dp) = {ratio:.3f}  (target within 10 %)  "
                     f"{'PASS' if abs(ratio - 1) <= 0.10 else 'MISS'}")
        for other, goal in (("fsdp2", 1.05), ("ddp", 1.0)):
            if ok(other):
                x = f["tokens_per_s_per_gpu"] / results[other]["tokens_per_s_per_gpu"]
                lines.append(f"FSDP / {other.upper()} throughput {x:.3f}x  (target >= {goal}x)  "
                             f"{'PASS' if x >= goal else 'MISS'}")
        if ok("fsdp2"):
            a, b = f["peak_bytes"], results["fsdp2"]["peak_bytes"]
            lines.append(f"FSDP peak {a / 2**30:.2f} GiB vs FSDP2 {b / 2**30:.2f} GiB  (target FSDP <= FSDP2)  "
                         f"{'PASS' if a <= b else 'MISS'}")
    return lines


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The options engine_config reads (shared with bench/max_model.py)."""
    on_gpu = torch.cuda.is_available()
    ap.add_argument("--attention", default="sdpa", choices=["local", "sdpa"])
    ap.add_argument("--dtype", default="bf16" if on_gpu else "fp32", choices=["bf16", "fp32"])
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    ap.add_argument("--fused-kernels", action="store_true", help="EngineConfig.fused_kernels: compiled RoPE + SwiGLU")
    ap.add_argument("--fsdp-overrides", default='{"overlap_param_gather": true}',
                    help="JSON for EngineConfig.override_ddp_config in the fsdp modes")
    ap.add_argument("--ddp-overrides", default='{"overlap_grad_reduce": true}',
                    help="JSON for EngineConfig.override_ddp_config in the ddp mode")
    ap.add_argument("--timeout-s", type=float, default=600.0)


def parse_modes(ap: argparse.ArgumentParser, text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        if m not in VARIANTS:
            ap.error(f"mode {m!r} is not one of {', '.join(VARIANTS)}")
    return modes


def main() -> None:
    on_gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default="1.7b" if on_gpu else "tiny", choices=list(SPECS))
    add_engine_args(ap)
    ap.add_argument("--micro-batch-size", type=int, default=4 if on_gpu else 2)
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: mbs * world)")
    ap.add_argument("--steps", type=int, default=8, help="measured steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--modes", default="ddp,fsdp,fsdp2", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--profile", action="store_true",
                    help=f"profile {PROFILE_STEPS} extra steps of the --profile-modes; traces next to --out")
    ap.add_argument("--profile-modes", default="ddp,fsdp,fsdp2", help="modes --profile covers ('all': every mode)")
    ap.add_argument("--out", default="runs/bench/throughput.json")
    args = ap.parse_args()
    modes = parse_modes(ap, args.modes)
    args.profile_modes = modes if args.profile_modes == "all" else parse_modes(ap, args.profile_modes)
    spec = SPECS[args.spec]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args.global_batch = args.global_batch or args.micro_batch_size * world
    if args.global_batch % (args.micro_batch_size * world):
        ap.error(f"--global-batch {args.global_batch} must be a multiple of micro-batch * world = "
                 f"{args.micro_batch_size * world}")
    data = batches(spec, n=args.warmup + args.steps, global_batch=args.global_batch)
    results = {m: run_mode(m, spec, data, args) for m in modes}
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        print_report(results, spec, args, world)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), spec=vars(spec), params=spec.param_count(),
                           matmul_params=matmul_params(spec), flops_per_token=flops_per_token(spec),
                           peak_flops_per_gpu=PEAK_FLOPS_PER_GPU, world=world, results=results,
                           targets=targets(results)), f, indent=1)
        print("wrote", args.out)
    runtime.shutdown(destroy_process_group=True)


if __name__ == "__main__":
    main()
