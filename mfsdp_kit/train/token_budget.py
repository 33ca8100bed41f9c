"""How many tokens a packed micro-batch may hold: the token budget from the device's memory (`memory_budget`,
which `packing.budget` asks when no `max_tokens_per_micro_batch` is given).

A model's first training call and every no-grad call plan with a per-token formula (`activation_bytes_per_token`)
in a share of the free memory, less Adam's moments still to come. The first training call also measures its peak
bytes per token (`measuring`); once an optimizer step has made Adam's moments, the next call plans what fits beside
the bytes allocated then (`measured_tokens`), and keeps it. Every rank plans alike (the minimum over ranks). None off
a GPU: host memory is not what limits a CPU run.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from ..distributed import runtime

MEMORY_FRACTION = 0.5
"""Share of the device memory that no tensor holds (when a model first asks; for training, less Adam's state still
to come: `optimizer_state_bytes`) a micro-batch's activations may take. The rest is headroom: the allocator's
blocks cut for other (ragged) shapes, a kept rollout cache."""
ADAM_STATE_BYTES_PER_PARAM = 8
"""Adam's two fp32 moments per trainable parameter."""


def optimizer_state_bytes(chunks) -> int:
    """Bytes Adam's moments take on this rank: its data-parallel share of the trainable parameters (the distributed
    optimizer shards them). The first optimizer step makes them, after a training budget is decided, so the budget
    sets them aside (twice, where they already exist: a smaller budget, never an out-of-memory; at 7.6 B on one
    GPU they are 61 GB, more than the headroom MEMORY_FRACTION leaves)."""
    from megatron.core import parallel_state as ps
    trainable = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
    return ADAM_STATE_BYTES_PER_PARAM * trainable // ps.get_data_parallel_world_size()


def tokens_that_fit(*, free_bytes: int, per_token_bytes: int, reserved_bytes: int = 0) -> int:
    """Tokens whose activations fit in MEMORY_FRACTION of what is free after `reserved_bytes`, a multiple of 256."""
    return int(MEMORY_FRACTION * max(0, free_bytes - reserved_bytes) // per_token_bytes) // 256 * 256


def activation_bytes_per_token(config, *, vocab_size: int, forward_only: bool) -> int:
    """Bytes one token's activations take on one rank (tensor-parallel splits divided out), for megatron's pre-norm
    layer with fused attention (no sequence x sequence term; Korthikanti et al. 2022), compute dtype e bytes:

      training, kept for the backward per layer: the two norm inputs 2h and outputs 2h, q/k/v out (h + 2gd, alive
      through v), q and k rotated (h + gd), attention out h, fc1 out (2 if gated else 1) f, fc2 in f
      -> e (8h + 3gd + 3f) for a gated MLP; the loss: logits e V, megatron's fp32 copy, exp and grad 12 V;
      no grad: one layer's widest tensors at a time, e (5h + 3gd + 3f), and the loss's (e + 8) V.
    h hidden, g kv heads, d head dim, f ffn width, V vocabulary. Measured, a token took about a quarter more than
    this formula at 1.37 B and over a quarter less at tiny `l` with the Triton fusions (docs/benchmarks.md, "The
    update's host gaps, named; its token budget from a measured peak"). Hence a model's first training call only
    plans with it (`memory_budget` then measures)."""
    tp = config.tensor_model_parallel_size
    e = config.params_dtype.itemsize if hasattr(config.params_dtype, "itemsize") else 4
    h, d, f = config.hidden_size, config.kv_channels, config.ffn_hidden_size // tp
    gd = config.num_query_groups * d // tp
    mlp = (2 if config.gated_linear_unit else 1) * f + f
    layers = config.num_layers // config.pipeline_model_parallel_size
    if forward_only:
        return e * (5 * h + 3 * gd + mlp) + (e + 8) * vocab_size // tp
    return layers * e * (8 * h + 3 * gd + mlp) + (e + 12) * vocab_size // tp


HEADROOM_FRACTION = 0.1
"""Share of the device's memory a measured training budget leaves unplanned: blocks the allocator has cut for
other shapes (a few percent of the device when 16k tokens ran out of memory: docs/benchmarks.md, "The update's
host gaps, named; its token budget from a measured peak") and what grows outside torch's allocator (NCCL, cuBLAS
workspaces)."""
MEASURE_MIN_TOKENS = 1024
"""A first call whose largest micro-batch holds fewer tokens measures nothing (`measuring`): its one-off bytes (a
rank given only a one-token filler, say) would pass for bytes per token, and the formula's budget stays."""
UNMEASURED = 2**62
"""What a rank without a measure offers the minimum over ranks (`memory_budget`): no bound."""


def measured_tokens(*, total_bytes: int, outside_bytes: int, allocated_bytes: int, per_token_bytes: float) -> int:
    """Tokens whose measured activations (`per_token_bytes`, `measuring`) fit in the device's `total_bytes` less
    what lives outside torch's allocator, less HEADROOM_FRACTION of it, less what tensors hold now; a multiple
    of 256."""
    room = total_bytes * (1 - HEADROOM_FRACTION) - outside_bytes - allocated_bytes
    return int(max(0.0, room) // max(per_token_bytes, 1.0)) // 256 * 256


def memory_budget(chunks, *, forward_only: bool) -> int | None:
    """Tokens per micro-batch whose activations fit the device, the minimum over all ranks (every rank must plan
    alike). A model's first call of each kind takes `activation_bytes_per_token` in `MEMORY_FRACTION` of the device
    memory no tensor holds (training: less `optimizer_state_bytes`), a multiple of 256 (`tokens_that_fit`). Its
    first training call also measures its peak bytes per token (`measuring`); the next training call re-decides
    from that (`measured_tokens`: the formula missed by -20 % to +40 % across models) once an optimizer step has
    made Adam's moments (`optimizer_stepped`: an fp16 run skips its first steps), and that budget is kept.
    None on CPU (host memory is not what limits a CPU run; the padded rule keeps CPU runs as they were)."""
    device = runtime.current().device
    if device.type != "cuda":
        return None
    kept, model = decided_budgets(chunks), chunks[0]
    per_token = measured_bytes_per_token(chunks)
    if (not forward_only and per_token is not None and getattr(model, "_kit_optimizer_stepped", False)
            and not getattr(model, "_kit_budget_measured", False)):
        free, total = torch.cuda.mem_get_info(device)
        mine = UNMEASURED if math.isnan(per_token) else measured_tokens(
            total_bytes=total, outside_bytes=total - free - torch.cuda.memory_reserved(device),
            allocated_bytes=torch.cuda.memory_allocated(device), per_token_bytes=per_token)
        n = _least_over_ranks(mine, device=device)
        if n < UNMEASURED:   # else no rank measured: the formula's budget stays
            kept[False] = n
        model._kit_budget_measured = True
    if forward_only not in kept:
        from ..distributed.engine import unwrap_model
        unwrapped = unwrap_model(chunks)[0]
        free = torch.cuda.get_device_properties(device).total_memory - torch.cuda.memory_allocated(device)
        per_token = activation_bytes_per_token(unwrapped.config, vocab_size=unwrapped.vocab_size,
                                               forward_only=forward_only)
        reserved = 0 if forward_only else optimizer_state_bytes(chunks)
        kept[forward_only] = _least_over_ranks(tokens_that_fit(free_bytes=free, per_token_bytes=per_token,
                                                               reserved_bytes=reserved), device=device)
    model._kit_token_budget = kept
    return kept[forward_only]


def _least_over_ranks(tokens: int, *, device) -> int:
    """The smallest of every rank's `tokens`, at least 256."""
    import torch.distributed as dist
    n = torch.tensor([tokens], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    return max(256, int(n.item()))


@contextmanager
def measuring(chunks, *, largest: int | None, forward_only: bool):
    """Around a model's first packed training forward/backward on a GPU (`largest`: its largest micro-batch's tokens,
    `packing.largest_packed`; None: padded, or a budget given): its peak allocated bytes above what was allocated
    before, over `largest`, is kept as the model's bytes per token for `memory_budget` (NaN where `largest` is under
    MEASURE_MIN_TOKENS). It counts the call's one-off bytes too, so it errs large. Resets torch's peak counter once
    (as `perf.peaks` does); elsewhere it does nothing."""
    model = chunks[0]
    probe = (not forward_only and largest is not None and runtime.current().device.type == "cuda"
             and measured_bytes_per_token(chunks) is None)
    if not probe:
        yield
        return
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    yield
    peak = max(0, torch.cuda.max_memory_allocated() - before)
    model._kit_bytes_per_token = peak / largest if largest >= MEASURE_MIN_TOKENS else math.nan


def optimizer_stepped(chunks) -> None:
    """Note that an optimizer step updated this model (`train.start_step`): Adam's moments exist now, so a measured
    budget (`memory_budget`) need not set them aside. The same step succeeds or is skipped on every rank."""
    chunks[0]._kit_optimizer_stepped = True


def measured_bytes_per_token(chunks) -> float | None:
    """The peak bytes per token this model's first packed training call measured (`measuring`); None before it
    or off a GPU, NaN where that call was too small to measure."""
    return getattr(chunks[0], "_kit_bytes_per_token", None)


def decided_budgets(chunks) -> dict[bool, int]:
    """The token budgets `memory_budget` has decided for this model so far, keyed by `forward_only` (training:
    False, no-grad: True); empty before its first call or off a GPU."""
    return dict(getattr(chunks[0], "_kit_token_budget", {}))
