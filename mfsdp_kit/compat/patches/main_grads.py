"""The two instance patches behind `grad_upcast` (compat/access/main_grads.py says why; these change objects).

- `compat.apply("defer_main_grads", buffer=)`: the buffer's end-of-backward `update_main_grads` does nothing; the
  fp32 copies are made a part at a time inside the optimizer step (`access.main_grads.make_main_grads`).
- `compat.apply("grads_for_norm", optimizer=, fn=)`: one megatron optimizer's `get_main_grads_for_grad_norm` is `fn`.
"""
from __future__ import annotations

from ..registry import Patch, record

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


def _defer(*, buffer) -> None:
    """Make the buffer's end-of-backward `update_main_grads` do nothing (idempotent)."""
    buffer.update_main_grads = _skip
    record(DEFERRED)


def deferred(buffer) -> bool:
    """Whether `_defer` was applied to this buffer."""
    return vars(buffer).get("update_main_grads") is _skip


def _replace_grads_for_norm(*, optimizer, fn) -> None:
    """`optimizer.get_main_grads_for_grad_norm = fn` on one megatron optimizer (idempotent for the same fn)."""
    optimizer.get_main_grads_for_grad_norm = fn
    record(GRADS_FOR_NORM)
