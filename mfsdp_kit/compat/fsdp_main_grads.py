"""Megatron-FSDP's fp32 grad copies, made where `grad_upcast` says instead of at the end of backward.

Two instance patches, each a `registry` row (applied by `grad_upcast.install`, per buffer / per optimizer):
- `defer(buffer)`: `ParamAndGradBuffer.update_main_grads` (param_and_grad_buffer.py:2615-2680) copies EVERY
  bf16 grad shard to fp32 (line 2649: `optimizer_grad.to(param.dtype)`) when backward's reduce-scatter ends; the
  deferred buffer does nothing then, and `make_main_grads(buffer, named_params=)` runs megatron's own method
  over one part of the params inside the optimizer step.
- `replace_grads_for_norm(opt, fn)`: megatron's `get_main_grads_for_grad_norm` (optimizer.py:136-161) reads the
  fp32 grads (`param.grad._local_tensor`, line 149), which do not exist yet when the norm is taken; `fn` reads the bf16
  shards (`bf16_shard`) instead.
The rest are the buffer reads those need.
"""
from __future__ import annotations

import torch

from .fsdp import grad_buffer, is_fsdp
from .registry import Patch, record

DEFERRED = Patch(
    target="megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer:ParamAndGradBuffer."
           "update_main_grads",
    upstream="megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:2615-2680 (every bf16 "
             "grad shard copied to fp32 at the end of backward, line 2649), instance patch per buffer",
    needed_if="optimizer_grad = optimizer_grad.to(param.dtype)")
GRADS_FOR_NORM = Patch(
    target="megatron.core.optimizer.optimizer:MegatronOptimizer.get_main_grads_for_grad_norm",
    upstream="megatron/core/optimizer/optimizer.py:136-161 (the norm read from param.grad, the fp32 copies, line 149), "
             "instance patch per inner optimizer",
    needed_if="grad = param.grad._local_tensor if param.grad is not None else None")


def _skip() -> None:
    """update_main_grads at the end of backward: the fp32 grads are made in the optimizer step instead."""


def buffers(chunks) -> list | None:
    """The grad buffer of every chunk, or None where any chunk is not Megatron-FSDP."""
    if not all(is_fsdp(c) for c in chunks):
        return None
    return [grad_buffer(c) for c in chunks]


def optimizer_params(buffer) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, sharded param) of every param the optimizer steps from this buffer, in megatron's order."""
    return list(buffer.optimizer_named_parameters)


def bf16_shard(buffer, param) -> torch.Tensor | None:
    """This rank's shard of `param`'s reduced gradient, in the grad buffer's dtype (a view, no copy); None for
    a param without a grad buffer. The same item update_main_grads copies."""
    orig = param.orig_param
    group = buffer.parameter_groups[buffer.param_to_param_group[orig]]
    gbuf = group.main_grad_buffer
    if gbuf is None or group.main_weight_buffer is None:
        return None
    sharded = buffer.bucketing_policy.data_parallel_sharding_strategy != "no_shard"
    return gbuf.get_item(gbuf.param_idx[orig], only_shard=sharded)


def defer(buffer) -> None:
    """Make the buffer's end-of-backward `update_main_grads` do nothing (see the module docstring)."""
    buffer.update_main_grads = _skip
    record(DEFERRED)


def deferred(buffer) -> bool:
    return vars(buffer).get("update_main_grads") is _skip


def make_main_grads(buffer, *, named_params: list[tuple[str, torch.nn.Parameter]]) -> None:
    """megatron's own update_main_grads over `named_params` only (fp32 copies, `param.grad` set)."""
    every = buffer.optimizer_named_parameters
    buffer.optimizer_named_parameters = named_params
    try:
        type(buffer).update_main_grads(buffer)
    finally:
        buffer.optimizer_named_parameters = every


def drop_main_grad(buffer, name: str) -> None:
    """Free the fp32 grad copy the buffer keeps for `name` (megatron's zero_grad drops it the same way)."""
    held = buffer.dist_main_grad.get(name)
    if held is not None:
        held._local_tensor = None


def replace_grads_for_norm(opt, fn) -> None:
    """`opt.get_main_grads_for_grad_norm = fn` on one megatron optimizer (see the module docstring)."""
    opt.get_main_grads_for_grad_norm = fn
    record(GRADS_FOR_NORM)
