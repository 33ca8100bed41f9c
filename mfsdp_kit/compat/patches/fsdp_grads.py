"""Megatron-FSDP 0.16.1 doubles the gradients of a parameter group whose FSDP group has one rank.

The naive picture: a gradient bucket is reduce-scattered into a fresh shard, and the shard is
added to this rank's local gradient buffer (`local_grad += reduced_grad`,
distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:3257). That holds when the buffer is
distributed: the bucket is then a temporary copy. But a buffer is distributed only when its group
has more than one rank (:2029 `is_data_distributed=... and main_buf_dp_group.size() > 1`); with one
rank, `fetch_bucket` (:936-942) hands back a view of the buffer itself, which already holds the
gradient, and the addition doubles it (measured: every expert gradient exactly 2x, grad norm
2.147 vs 2.140, at expert-parallel size 2 on 2 ranks, where each expert's FSDP group - its
expert-data-parallel group - is one rank). The comment at :3254-3256 assumes only no_shard
buffers are undistributed.

The fix, a rewrite of `GradReducePipeline._bucket_group_gradient_reduce` from its own source: for an
undistributed buffer the reduced shard *replaces* the local one (the bucket was the buffer, so the
reduction already includes every earlier micro-batch); a distributed buffer still adds.
"""
from __future__ import annotations

import inspect
import textwrap

from .. import registry

MODULE = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"
TARGET = f"{MODULE}:GradReducePipeline._bucket_group_gradient_reduce"
APPEND, ADD = "reduced_grad.append(grad_shard)", "local_grad += reduced_grad"


def still_needed() -> bool:
    """True while upstream adds the reduced shard into the local buffer whatever the buffer is."""
    return ADD in registry.upstream_source(TARGET)


def _enable() -> bool:
    """Apply the rewrite once; returns whether it did (False when upstream changed the lines)."""
    import importlib
    module = importlib.import_module(MODULE)
    cls = module.GradReducePipeline
    original = cls._bucket_group_gradient_reduce
    if hasattr(original, "__wrapped__"):
        return False
    source = textwrap.dedent(inspect.getsource(original))
    if source.count(APPEND) != 1 or source.count(ADD) != 1:
        return False
    indent = next(line for line in source.splitlines() if ADD in line).split(ADD)[0]
    source = source.replace(APPEND, "reduced_grad.append((grad_shard, gbuf.is_data_distributed))")
    source = source.replace(f"{indent}{ADD}", (
        f"{indent}reduced_grad, distributed = reduced_grad\n"
        f"{indent}local_grad.add_(reduced_grad) if distributed else local_grad.copy_(reduced_grad)"))
    first_line = original.__code__.co_firstlineno
    namespace: dict = {}
    exec(compile("\n" * (first_line - 1) + source, inspect.getsourcefile(original), "exec"), module.__dict__,
         namespace)
    fixed = namespace[original.__name__]
    fixed.__wrapped__, fixed.__qualname__ = original, original.__qualname__
    cls._bucket_group_gradient_reduce = fixed
    registry.record(registry.Patch(
        target=TARGET, needed_if=still_needed,
        upstream="megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:936-942,2029,3257 "
                 "(the reduced shard is added into a one-rank group's buffer, which is the bucket: 2x grads)"))
    return True
