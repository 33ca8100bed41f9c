"""Everything that reaches into Megatron's (and torch's) internals, in one place.

The rest of the kit asks questions here instead of poking at wrapper attributes itself: is this
chunk Megatron-FSDP, which view do its parameters show, where are its buffers, which torch
optimizers sit inside megatron's. When megatron-core moves one of these attributes, this file is
the one to change. It imports nothing from the kit but `config`, so any module may import it.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from .config import DTYPES, bad_value

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""The kit's dtype names (EngineConfig.dtype, benchmark flags) -> torch dtypes."""

PARAM_VIEWS = ("sharded", "compute")


def torch_dtype(name: str) -> torch.dtype:
    """"bf16" | "fp16" | "fp32" -> the torch dtype; a ConfigError names anything else."""
    if name not in TORCH_DTYPES:
        raise bad_value("dtype", name, " | ".join(DTYPES))
    return TORCH_DTYPES[name]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor; any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def is_fsdp(chunk: torch.nn.Module) -> bool:
    """Is this chunk wrapped by megatron-core's Megatron-FSDP adapter?"""
    from megatron.core.distributed import FullyShardedDataParallel
    return isinstance(chunk, FullyShardedDataParallel)


def all_gather_pipelines(chunks) -> list:
    """Megatron-FSDP's parameter all-gather pipeline (`AllGatherPipeline`) of each FSDP chunk; none for DDP chunks."""
    return [chunk.module.all_gather_pipeline for chunk in chunks if is_fsdp(chunk)]


def param_view(chunk: torch.nn.Module) -> str | None:
    """Which parameters an FSDP chunk's module shows: "sharded" (DTensor shards, what the optimizer
    steps and exporters gather) or "compute" (the unsharded tensors a forward runs on); None for DDP."""
    if not is_fsdp(chunk):
        return None
    return "sharded" if chunk.module.is_param_fsdp_distributed else "compute"


def set_param_view(chunk: torch.nn.Module, view: str) -> bool:
    """Switch an FSDP chunk's parameters to `view`; False (nothing done) for a DDP chunk.

    "sharded" first waits for in-flight parameter all-gathers (megatron's
    `synchronize_param_gather`); "compute" puts back the raw parameters (a private megatron call).
    """
    if view not in PARAM_VIEWS:
        raise bad_value("view", view, " | ".join(PARAM_VIEWS))
    if not is_fsdp(chunk):
        return False
    if view == "sharded":
        chunk.module.synchronize_param_gather()
    else:
        chunk.module._replace_param_with_raw_if_needed()
    return True


def inner_optimizers(optimizer) -> list:
    """The megatron optimizers inside a ChainedOptimizer (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def main_params(optimizer) -> Iterator[torch.Tensor]:
    """The fp32 main weights a mixed-precision (distributed) optimizer keeps (DDP path)."""
    for opt in inner_optimizers(optimizer):
        for groups_name in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for group in getattr(opt, groups_name, []) or []:
                yield from group


def fsdp_buffers(chunks: Iterable[torch.nn.Module], name: str) -> Iterator[torch.Tensor]:
    """Megatron-FSDP's flat buffers of one kind ("model_weight_buffer", "main_weight_buffer",
    "main_grad_buffer") over every parameter group of every chunk."""
    for chunk in chunks:
        for group in chunk.module.param_and_grad_buffer.parameter_groups:
            buffer = getattr(group, name)
            if buffer is not None and getattr(buffer, "data", None) is not None:
                yield buffer.data
