"""Megatron-FSDP's fp32 grad copies, made where `grad_upcast` says instead of at the end of backward: the reads.

Two instance patches, each a `registry` row (compat/patches/main_grads.py: `compat.apply("defer_main_grads",
buffer=)` and `compat.apply("grads_for_norm", optimizer=, fn=)`, per buffer / per optimizer):
- deferred: `ParamAndGradBuffer.update_main_grads` (param_and_grad_buffer.py:2615-2680) copies EVERY
  bf16 grad shard to fp32 (line 2649: `optimizer_grad.to(param.dtype)`) when backward's reduce-scatter ends; the
  deferred buffer does nothing then, and `make_main_grads(buffer, named_params=)` runs megatron's own method
  over one part of the params inside the optimizer step.
- grads for the norm: megatron's `get_main_grads_for_grad_norm` (optimizer.py:136-161) reads the
  fp32 grads (`param.grad._local_tensor`, line 149), which do not exist yet when the norm is taken; `fn` reads the bf16
  shards (`bf16_shard`) instead.
This module holds the buffer reads those need, and `make_main_grads`, which calls megatron's own
method over a part (the buffer's param list is swapped for the call and put back).
"""
from __future__ import annotations

import torch

from .fsdp import grad_buffer, is_fsdp


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
