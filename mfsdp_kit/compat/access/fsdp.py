"""Megatron-FSDP's internals, asked here and nowhere else (the door: docs/design.md, "The door into megatron").

megatron-core's public `FullyShardedDataParallel` adapter wraps `MegatronFSDP`
(megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py), whose parameter buffers
(`param_and_grad_buffer`: parameter groups = FSDP units, their flat weight / main-weight / grad buffers) and
all-gather pipeline (`all_gather_pipeline`: which unit is gathered, release, wait) are not public API. The kit
needs them to switch parameter views, gather one unit at a time for export, measure memory, free a dropped
model, and make fp32 grads a part at a time. Every such access is a function of this module (reads) or of
`compat.patches.main_grads` / `fsdp_gather_hold` (changes, each a `registry` row); when megatron-core moves an
attribute, these files are the ones to change. tests/test_layout.py keeps every other module out.
"""
from __future__ import annotations

import gc
import sys
from typing import Iterable, Iterator

import torch

PARAM_VIEWS = ("sharded", "compute")
SOURCE = "megatron.core.distributed.fsdp.src.megatron_fsdp"
"""Megatron-FSDP's implementation package inside megatron-core 0.16.1."""


def is_fsdp(chunk: torch.nn.Module) -> bool:
    """Is this chunk wrapped by megatron-core's Megatron-FSDP adapter?"""
    from megatron.core.distributed import FullyShardedDataParallel
    return isinstance(chunk, FullyShardedDataParallel)


def megatron_fsdp_class() -> type:
    """`MegatronFSDP`, the module megatron's adapter wraps (what `chunk.module` is for an FSDP chunk)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP
    return MegatronFSDP


def all_gather_pipelines(chunks) -> list:
    """Megatron-FSDP's parameter all-gather pipeline (`AllGatherPipeline`) of each FSDP chunk; none for DDP chunks."""
    return [chunk.module.all_gather_pipeline for chunk in chunks if is_fsdp(chunk)]


def param_view(chunk: torch.nn.Module) -> str | None:
    """Which parameters an FSDP chunk's module shows: "sharded" or "compute"; None for DDP."""
    if not is_fsdp(chunk):
        return None
    return "sharded" if chunk.module.is_param_fsdp_distributed else "compute"


def set_param_view(chunk: torch.nn.Module, view: str) -> bool:
    """Switch an FSDP chunk's parameters to `view` (one of PARAM_VIEWS); False (nothing done) for DDP.

    "sharded" first waits for in-flight parameter all-gathers (megatron's `synchronize_param_gather`, after
    `settle_gathers`: megatron would wait for a forward's prefetches too, warning each time that it found them);
    "compute" puts back the raw parameters (a private megatron call)."""
    if not is_fsdp(chunk):
        return False
    if view == "sharded":
        pipeline = getattr(chunk.module, "all_gather_pipeline", None)
        if pipeline is not None:
            settle_gathers(pipeline)
        chunk.module.synchronize_param_gather()
    else:
        chunk.module._replace_param_with_raw_if_needed()
    return True


def fsdp_buffers(chunks: Iterable[torch.nn.Module], name: str) -> Iterator[torch.Tensor]:
    """Megatron-FSDP's flat buffers of one kind ("model_weight_buffer", "main_weight_buffer",
    "main_grad_buffer") over every parameter group of every chunk."""
    for chunk in chunks:
        for group in chunk.module.param_and_grad_buffer.parameter_groups:
            buffer = getattr(group, name)
            if buffer is not None and getattr(buffer, "data", None) is not None:
                yield buffer.data


def grad_buffer(chunk: torch.nn.Module):
    """The `ParamAndGradBuffer` of an FSDP chunk (its units, flat buffers and fp32 grad copies)."""
    return chunk.module.param_and_grad_buffer


def owner(chunks, param):
    """The MegatronFSDP whose buffers hold `param` (a compute parameter); None for DDP / plain chunks."""
    for chunk in chunks:
        if is_fsdp(chunk) and param in chunk.module.param_and_grad_buffer.param_to_param_group:
            return chunk.module
    return None


def unit_of(fsdp, param) -> int:
    """The FSDP unit (parameter group = all-gather bucket id) of `param` in `fsdp` (a MegatronFSDP)."""
    return fsdp.param_and_grad_buffer.param_to_param_group[param]


def param_ids(fsdp) -> tuple[int, ...]:
    """Ids of the compute parameters `fsdp` (a MegatronFSDP) shards, in its order."""
    return tuple(map(id, fsdp.param_and_grad_buffer.param_to_param_group))


def pipeline(fsdp):
    """The all-gather pipeline of `fsdp` (a MegatronFSDP)."""
    return fsdp.all_gather_pipeline


def release_unit(fsdp, unit: int) -> None:
    """Free a unit's gathered forward bucket (as megatron's post-forward hook would)."""
    fsdp.all_gather_pipeline.release_bucket(unit, bwd=False)


def gathered_units(fsdp) -> set[int]:
    """Units of `fsdp` whose forward bucket is gathered now (ready or still gathering)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import BucketStatus
    ag = fsdp.all_gather_pipeline
    return {b for b in range(ag.num_buckets) if ag.bucket_status[ag.get_bucket_key(b, False)] != BucketStatus.EMPTY}


def gathered_buckets(pipelines) -> int:
    """How many buckets (forward and backward keys) of these pipelines hold gathered weights now."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import BucketStatus
    return sum(s != BucketStatus.EMPTY for p in pipelines for s in p.bucket_status.values())


def settle_gathers(ag_pipeline) -> None:
    """Wait for every gather this pipeline has in flight (prefetches included) and mark its buckets ready."""
    while ag_pipeline.param_gather_event_map:
        bucket_id, bwd = next(iter(ag_pipeline.param_gather_event_map))
        ag_pipeline.wait_bucket_ready(bucket_id, bwd)


def remove_grad_hooks(modules: Iterable[torch.nn.Module]) -> None:
    """Remove each MegatronFSDP's per-parameter grad-accumulation hooks (`_register_fsdp_hooks`), which close
    over the wrapper in a cycle through C++ that gc cannot break. FSDP chunks and bare MegatronFSDPs alike."""
    megatron_fsdp = megatron_fsdp_class()
    for chunk in modules:
        inner = chunk.module if is_fsdp(chunk) else chunk
        if isinstance(inner, megatron_fsdp):
            for handle in getattr(inner, "grad_acc_hooks", {}).values():  # absent if its init failed
                handle.remove()
            inner.grad_acc_hooks = {}


def live_modules() -> list:
    """Every MegatronFSDP gc still sees in this process (none if megatron's FSDP was never imported)."""
    module = sys.modules.get(f"{SOURCE}.megatron_fsdp")
    if module is None:
        return []
    return [obj for obj in gc.get_objects() if issubclass(type(obj), module.MegatronFSDP)]  # type(): no __getattr__


def reset_buffer_pool() -> None:
    """Drop Megatron-FSDP's module-level buffer pool (megatron_fsdp/utils.py `_GLOBAL_MEMORY_BUFFER`, the
    fsdp_double_buffer pool): between two measured models only."""
    utils = sys.modules.get(f"{SOURCE}.utils")
    if utils is not None:
        utils._GLOBAL_MEMORY_BUFFER = None


def clear_main_grads(chunk: torch.nn.Module) -> None:
    """Free the fp32 grad copies `update_main_grads` keeps in `dist_main_grad` (no-op for DDP chunks)."""
    if is_fsdp(chunk):
        chunk.module.param_and_grad_buffer.dist_main_grad.clear()


def install_optimized_weights(chunk: torch.nn.Module) -> None:
    """Copy the optimizer's main weights into the chunk's model weights (after a checkpoint load)."""
    chunk.module.install_optimized_model_weights()


def preprocess_uneven_dtensors(state: dict) -> None:
    """Megatron-FSDP's `preprocess_state_dict_for_uneven_dtensor`: chunk metadata on every uneven DTensor."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import uneven_dtensor
    uneven_dtensor.preprocess_state_dict_for_uneven_dtensor(state)
