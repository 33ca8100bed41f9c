"""The questions the kit asks of megatron's wrappers and optimizers, answered in one place.

Is this chunk Megatron-FSDP, which view do its parameters show, where are its buffers, which torch
optimizers sit inside megatron's, what is this rank's piece of a DTensor. What concerns Megatron-FSDP's
internals is answered by `compat.access.fsdp`, the door into megatron (docs/design.md); this module re-exports
those answers beside the kit's own (dtype names, `local`) and imports nothing from the kit but
`config` and `compat.access.fsdp`, so any module may import it.
"""
from __future__ import annotations

from typing import Iterator

import torch

from ..compat.access import fsdp
from ..compat.access.fsdp import PARAM_VIEWS, all_gather_pipelines, fsdp_buffers, is_fsdp, param_view  # noqa: F401
from ..config import DTYPES, bad_value

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""The kit's dtype names (EngineConfig.dtype, benchmark flags) -> torch dtypes."""


def torch_dtype(name: str) -> torch.dtype:
    """"bf16" | "fp16" | "fp32" -> the torch dtype; a ConfigError names anything else."""
    if name not in TORCH_DTYPES:
        raise bad_value("dtype", name, " | ".join(DTYPES))
    return TORCH_DTYPES[name]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor; any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def set_param_view(chunk: torch.nn.Module, view: str) -> bool:
    """Switch an FSDP chunk's parameters to `view` ("sharded": the DTensor shards the optimizer steps and
    exporters gather, waiting for in-flight all-gathers first; "compute": the unsharded tensors a forward runs
    on); False (nothing done) for a DDP chunk."""
    if view not in PARAM_VIEWS:
        raise bad_value("view", view, " | ".join(PARAM_VIEWS))
    return fsdp.set_param_view(chunk, view)


def inner_optimizers(optimizer) -> list:
    """The megatron optimizers inside a ChainedOptimizer (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def grad_scalers(optimizer) -> list:
    """The loss scalers of megatron's optimizer (`grad_scaler` of each inner one): fp16's; none in bf16 or fp32."""
    return [s for s in (getattr(opt, "grad_scaler", None) for opt in inner_optimizers(optimizer)) if s is not None]


def loss_scale_at_floor(optimizer) -> bool:
    """Whether an fp16 optimizer's dynamic loss scale is at its smallest (megatron's `DynamicGradScaler.min_scale`):
    a step skipped there overflowed at every scale it could try. False without a dynamic scaler (bf16, fp32: nothing
    is read). A constant scale (`ConstantGradScaler`) is never at it: a step it skips is `skipped` and the run goes on,
    as megatron.training and DeepSpeed's static scale do (the next batch may not overflow). A dynamic scale is read
    on the host, a sync: fp16's step syncs anyway, to find an overflow."""
    return any(hasattr(s, "min_scale") and bool(s.scale <= s.min_scale) for s in grad_scalers(optimizer))


def main_params(optimizer) -> Iterator[torch.Tensor]:
    """The fp32 main weights a mixed-precision (distributed) optimizer keeps (DDP path)."""
    for opt in inner_optimizers(optimizer):
        for groups_name in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for group in getattr(opt, groups_name, []) or []:
                yield from group
