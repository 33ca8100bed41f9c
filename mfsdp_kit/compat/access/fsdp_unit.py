"""Megatron-FSDP 0.16.1 floors its communication unit at 1e9 elements where it means to cap it.

Megatron prefetches all-gathers up to unit // 2 elements ahead of the running layer and queues up
to unit elements of reduce-scatters before it waits. The unit it computes is twice the mean
elements of an FSDP unit (a TransformerLayer): prefetch about one layer ahead. Then it applies
`max(1_000_000_000, unit)` under the comment "Cap to 1B elements"
(distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py:393-396; upstream makes it `min`,
NVIDIA/Megatron-LM PR #7134). So every model below 500 M params per layer prefetches ~1e9 elements:
2 GB of bf16 weights, ten layers of a 1.4 B model, in flight at once.

The kit does not patch megatron for this: `unit_elements` computes the intended value and the
engine passes it as `suggested_communication_unit_size` when the user set none: a lower peak at the
same tokens/s (measured: docs/benchmarks.md, levers, "Unit = 2 x mean layer").
"""
from __future__ import annotations

import torch

from .. import registry

TARGET = "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp:MegatronFSDP._init_fsdp_param_and_grad_buffer"
CAP = 1_000_000_000
PATCH = registry.Patch(target=TARGET, needed_if="max(\n                1_000_000_000",
                       upstream="megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py:393-396 "
                                "(max where min is meant: a 1e9-element prefetch for every model below 500 M "
                                "params per layer)")


def unit_elements(module: torch.nn.Module, *, sharding_strategy: str) -> int | None:
    """What Megatron-FSDP would use with `min`: twice the mean elements of `module`'s
    TransformerLayers, at most 1e9. None (megatron decides) for other strategies or no layers."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    if sharding_strategy != "optim_grads_params":
        return None
    sizes = [sum(p.numel() for p in m.parameters()) for m in module.modules() if isinstance(m, TransformerLayer)]
    if not sizes:
        return None
    registry.record(PATCH)
    return min(CAP, sum(sizes) // len(sizes) * 2)
