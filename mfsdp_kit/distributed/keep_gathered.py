"""Megatron-FSDP's gathered weights kept from a step's first forward to the end of its backward
(`EngineConfig.wrapper.fsdp_keep_gathered`): one all-gather per FSDP unit per step instead of two per micro-batch.

Under optim_grads_params, megatron-core 0.16.1 frees a unit's gathered weights after its forward (a post-forward
hook) and gathers them again for its backward, in every micro-batch: a step of k micro-batches gathers each layer
2k times, and each gather is host work in the hooks and NCCL time that the GPU may wait on. megatron-core 0.16.1
has no knob to keep them (`no_sync` defers only the gradient reduce-scatter); FSDP2 calls it
`reshard_after_forward=False`.

How (the instance patch is `compat.patches.fsdp_gather_hold`, a registry row): while a step is `held`,
`AllGatherPipeline.release_bucket` does nothing (its lazy variant included), so a unit
gathered once stays READY_TO_USE, and every later gather of it returns at once (`async_bucket_gather` skips a bucket
that is not EMPTY). The hold ends where megatron resets the pipeline once the step's gradients are synchronised
(`finish_grad_sync`), which frees every bucket; the end of the step frees any left (a forward-only step).
`generate.greedy` holds too: one gather per unit per call instead of one per unit per decoded token.
Between steps the memory is ZeRO-3's, and the optimizer's update reaches the next forward through a fresh gather.

Cost: the model's whole weights in the compute dtype (2 B/param in bf16, not divided by the N ranks; fp8 would
also keep its transpose buffers) from the first forward to the end of backward, on top of the activations. The numbers do not change: the same gathered
bytes are used (bit-equal losses, grad norms and weights: tests/distributed/test_keep_gathered.py). It needs megatron's
default bucket allocator: its double buffer (`fsdp_double_buffer`, `nccl_ub`) has two slots for all units, which
is why `EngineConfig.validate` refuses that pair.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch

from ..compat.access import fsdp
from ..compat.patches.fsdp_gather_hold import HOLD, release_all   # the patch itself: compat.apply("keep_gathered")
from .introspect import all_gather_pipelines


@contextlib.contextmanager
def held(chunks: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Keep every gathered bucket of these chunks' installed pipelines until the block ends, then free them all
    (also on error). Chunks built without `fsdp_keep_gathered` (not installed) run as megatron runs them."""
    # installed and not yet held (a block inside another leaves the pipeline to the outer one)
    held_pipelines = [p for p in all_gather_pipelines(chunks) if getattr(p, HOLD, True) is False]
    for pipeline in held_pipelines:
        setattr(pipeline, HOLD, True)
    try:
        yield
    finally:
        for pipeline in held_pipelines:
            setattr(pipeline, HOLD, False)
            release_all(pipeline)


def gathered_buckets(chunks: Iterable[torch.nn.Module]) -> int:
    """How many of these chunks' buckets hold gathered weights now (READY_TO_USE or still gathering)."""
    return fsdp.gathered_buckets(all_gather_pipelines(chunks))
