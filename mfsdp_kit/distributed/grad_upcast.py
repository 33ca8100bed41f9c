"""Megatron-FSDP's optimizer step without a whole fp32 copy of the gradient shard.

Adam keeps fp32 main weights; Megatron-FSDP reduce-scatters bf16 gradients. megatron-core 0.16.1 bridges the
two in `update_main_grads` (megatron_fsdp/param_and_grad_buffer.py:2615-2680): when backward's reduce-scatter
ends it copies EVERY bf16 grad shard to fp32 (`optimizer_grad.to(param.dtype)`) and keeps the copies until the
next zero_grad. That is +4 B per local element through the optimizer step, on top of the 16 B/param / N of
state; it makes the step the peak of a large model, so Megatron-FSDP grew faster per layer than FSDP2 and trained
a smaller largest model (docs/benchmarks.md, max_model). megatron's own fix, the precision-aware optimizer, needs
Transformer Engine's FusedAdam.

`install` moves the copies into the step and makes them a part at a time (`part_bytes` of fp32, 256 MiB by
default):
    backward ends      update_main_grads does nothing; the bf16 shards stay where they are
    grad norm          read from the bf16 shards, accumulated in fp32 (`compat.patches.grad_norm`): the same bits as
                       the norm of their fp32 copies
    clip               the factor is kept on each param (`compat.patches.grad_norm.LATER_SCALE`) instead of scaling
                       grads that do not exist yet
    step, per part     megatron's own update_main_grads over the part's params -> fp32 grads, times the clip
                       factor -> torch's Adam (it steps only params that have a grad; its state is per param)
                       -> the part's fp32 grads dropped
Every float operation is the one megatron's step does on the same numbers, so the weights come out bit for bit
the same (tests/distributed/test_grad_upcast.py); the step's peak holds one part of fp32 grads instead of the shard.
Measured (docs/benchmarks.md, "levers, seventh set"): a lower optimizer-step peak at the same or slightly better
tokens/s, and a larger largest model (FSDP2's with full recompute).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import compat
from . import step_pipeline
from ..compat.access import main_grads
from ..compat.patches.main_grads import deferred
from ..compat.patches.grad_norm import LATER_SCALE
from .introspect import grad_scalers, inner_optimizers, local

PART_BYTES = 256 * 2**20


@dataclass
class Entry:
    """One optimizer param whose fp32 grad the step makes: its Megatron-FSDP buffer and name there."""
    buffer: object
    name: str
    param: torch.nn.Parameter
    nbytes: int   # of its fp32 grad shard on this rank


def install(chunks: list[torch.nn.Module], optimizer, *, part_bytes: int = PART_BYTES) -> bool:
    """Make `optimizer`'s fp32 grads a part of at most `part_bytes` at a time inside its step (see the module
    docstring). Returns False and changes nothing where there is no copy to save: DDP chunks, fp32 grads
    (`grad_reduce_in_fp32`, an fp32 model), an optimizer that is not torch's Adam over FSDP params only; and
    in fp16, whose loss scaler needs every fp32 grad before the step."""
    entries = _entries(chunks)
    by_param = {id(e.param): e for e in entries}
    torch_opts = [getattr(opt, "optimizer", None) for opt in inner_optimizers(optimizer)]
    if not entries or any(not isinstance(t, torch.optim.Adam) for t in torch_opts):
        return False
    if grad_scalers(optimizer):
        return False   # fp16: megatron unscales every fp32 grad, and tests them for inf, before the step
    params = [p for t in torch_opts for g in t.param_groups for p in g["params"]]
    if any(id(p) not in by_param for p in params) or len(params) != len(entries):
        return False
    if installed(chunks):
        return True   # once: a second wrap would step every part once per part
    for buffer in {id(e.buffer): e.buffer for e in entries}.values():
        compat.apply("defer_main_grads", buffer=buffer)
    for entry in entries:
        setattr(entry.param, LATER_SCALE, None)
    for opt in inner_optimizers(optimizer):
        compat.apply("grads_for_norm", optimizer=opt, fn=_grads_for_norm(opt, by_param))
    step_pipeline.add(optimizer, stage="grad_upcast",
                      wrap=lambda step, torch_opt: _step_in_parts(step, torch_opt, by_param, part_bytes))
    return True


def installed(chunks: list[torch.nn.Module]) -> bool:
    """Whether these chunks' fp32 grads are made by part in the optimizer step."""
    return any(deferred(b) for b in main_grads.buffers(chunks) or [])


def _entries(chunks) -> list[Entry]:
    """Every optimizer param of every Megatron-FSDP chunk whose bf16 grad megatron would copy to fp32."""
    entries = []
    for buffer in main_grads.buffers(chunks) or []:
        for name, param in main_grads.optimizer_params(buffer):
            shard = main_grads.bf16_shard(buffer, param)
            if shard is None or shard.dtype == param.dtype:
                return []   # fp32 grads: megatron makes no copy
            entries.append(Entry(buffer, name, param, shard.numel() * param.element_size()))
    return entries


def _grads_for_norm(opt, by_param):
    """megatron's get_main_grads_for_grad_norm (optimizer.py:136-161) with each param's bf16 shard in place
    of its fp32 grad, same order and filters (shared and tensor-parallel duplicates left out)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    def grads_for_norm() -> list[torch.Tensor]:
        grads = []
        for param in opt.get_parameters():
            entry = by_param[id(param)]
            grad = main_grads.bf16_shard(entry.buffer, param)
            if grad.numel() and param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(
                    param, getattr(opt, "tp_group", None)):
                grads.append(grad)
        return grads
    return grads_for_norm


def parts(entries: list[Entry], part_bytes: int) -> list[list[Entry]]:
    """`entries` in order, cut into runs of at most `part_bytes` of fp32 grads (a bigger param is a part alone)."""
    out, size = [], 0
    for entry in entries:
        if not out or (size + entry.nbytes > part_bytes and out[-1]):
            out.append([])
            size = 0
        out[-1].append(entry)
        size += entry.nbytes
    return out


def _step_in_parts(step, torch_opt: torch.optim.Adam, by_param, part_bytes: int):
    """`step` (torch_opt's), run once per part with only that part's params holding an fp32 grad: the pipeline's
    `grad_upcast` stage (step_pipeline)."""
    entries = [by_param[id(p)] for g in torch_opt.param_groups for p in g["params"]]
    plan = parts(entries, part_bytes)

    def step_in_parts(closure=None):
        assert closure is None, "a closure would re-run forward/backward once per part"
        for part in plan:
            _make_grads(part)
            step()
            _drop_grads(part)
    return step_in_parts


def _make_grads(part: list[Entry]) -> None:
    """megatron's update_main_grads over the part's params only (fp32 copies, `param.grad` set), then the clip
    factor applied to them in fp32 as megatron's clip would have."""
    for buffer in {id(e.buffer): e.buffer for e in part}.values():
        main_grads.make_main_grads(buffer, named_params=[(e.name, e.param) for e in part if e.buffer is buffer])
    by_scale: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    for e in part:
        scale = getattr(e.param, LATER_SCALE)
        if scale is not None and e.param.grad is not None:
            by_scale.setdefault(id(scale), (scale, []))[1].append(local(e.param.grad))
        setattr(e.param, LATER_SCALE, None)
    for scale, grads in by_scale.values():
        torch._foreach_mul_(grads, scale)


def _drop_grads(part: list[Entry]) -> None:
    """Free the part's fp32 grads (megatron's zero_grad drops them the same way)."""
    for e in part:
        e.param.grad = None
        main_grads.drop_main_grad(e.buffer, e.name)
