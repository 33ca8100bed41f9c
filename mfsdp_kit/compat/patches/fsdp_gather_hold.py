"""An instance patch of Megatron-FSDP's all-gather pipeline: its releases skipped while a step holds it.

`keep_gathered` (EngineConfig.wrapper.fsdp_keep_gathered) keeps each FSDP unit gathered from a step's first forward to
the end of its backward. megatron-core 0.16.1 has no knob for that (`DistributedDataParallelConfig` has no
`reshard_after_forward`, which only its torch-FSDP2 config knows): `AllGatherPipeline.release_bucket`
(megatron_fsdp/param_and_grad_buffer.py:3649) frees a unit after every forward and backward.
`compat.apply("keep_gathered", pipeline=)` routes that method through a hold flag and ends the hold at
`AllGatherPipeline.reset` (line 3418), per pipeline instance; the row below says so, and tests/compat/test_instance_patches.py fails once megatron gains the knob.
"""
from __future__ import annotations

from ..registry import Patch, record, upstream_source

HOLD = "_mfsdp_kit_keep_gathered"
"""Attribute of an `AllGatherPipeline`: absent (not installed), False (megatron's releases), True (held)."""


def _no_knob() -> bool:
    return "reshard_after_forward" not in upstream_source("megatron.core.distributed.distributed_data_parallel_config")


PATCH = Patch(target="megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer:AllGatherPipeline."
                     "release_bucket",
              upstream="megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:3649 "
                       "(release_bucket after each forward/backward) and :3418 (reset), instance patch per "
                       "pipeline; distributed_data_parallel_config.py has no reshard_after_forward",
              needed_if=_no_knob)


def _install(*, pipeline) -> None:
    """Route `pipeline.release_bucket` through the hold flag, and end the hold at `pipeline.reset` (once per
    pipeline; the flag starts off). megatron resets the pipeline when the step's gradients are synchronised
    (`finish_grad_sync` -> `synchronize_param_gather`), freeing every bucket: that is where a held step lets go."""
    if hasattr(pipeline, HOLD):
        return
    setattr(pipeline, HOLD, False)
    release, reset = pipeline.release_bucket, pipeline.reset

    def release_unless_held(bucket_id, bwd, lazy: bool = False):
        if getattr(pipeline, HOLD):
            return None
        return release(bucket_id, bwd, lazy=lazy)

    def reset_and_let_go():
        setattr(pipeline, HOLD, False)
        return reset()
    pipeline.release_bucket = release_unless_held   # recycle_unused_buckets calls it through the instance too
    pipeline.reset = reset_and_let_go
    record(PATCH)


def release_all(pipeline) -> None:
    """Free every gathered bucket (forward and backward keys), as megatron's post-backward hooks would have."""
    for bucket_id in range(pipeline.num_buckets):
        for bwd in (False, True):
            pipeline.release_bucket(bucket_id, bwd)
    for key in pipeline.bucket_can_be_released:
        pipeline.bucket_can_be_released[key] = False
