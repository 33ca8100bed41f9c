"""What Megatron-Bridge's conversion mappings do to a dense weight, as views of the full megatron parameter.

With TP = PP = EP = 1 every mapping `weights.plan` replays is a view: a plain copy, a transpose (`permute_dims`), the
per-query-group split of the fused QKV, the gate/up halves of a fused SwiGLU fc1, the vocabulary rows `vocab.trim`
keeps. `recognised()` maps each bridge mapping class (exactly: a subclass may change values) to the views of its HF
tensors; `weights.plan` checks each one against the bridge on a random probe before it trusts it.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from ..compat.access import bridge_model

View = Callable[[torch.Tensor], torch.Tensor]
"""full megatron parameter -> a view of it with the HF tensor's elements (any shape of its numel)."""


def whole(full: torch.Tensor) -> torch.Tensor:
    return full


def permuted(full: torch.Tensor, *, dims: tuple[int, ...]) -> torch.Tensor:
    return full.permute(dims)


def half(full: torch.Tensor, *, index: int) -> torch.Tensor:
    """GatedMLPMapping: megatron's fc1 is [gate; up] along rows."""
    return full.chunk(2, dim=0)[index]


def qkv(full: torch.Tensor, *, groups: int, per_group: int, head_size: int, part: str) -> torch.Tensor:
    """QKVMapping: rows are, per query group, `per_group` query heads, then one key, one value head."""
    grouped = full.view(groups, per_group + 2, head_size, *full.shape[1:])
    if part == "q":
        return grouped[:, :per_group]
    return grouped[:, per_group + (part == "v")]


def rows(full: torch.Tensor, *, view: View, rows: int) -> torch.Tensor:
    """vocab.trim: the padded vocabulary rows never leave."""
    return view(full)[:rows]


def _direct_views(mapping, module) -> dict[str, View]:
    dims = getattr(mapping, "permute_dims", None)
    return {str(mapping.hf_param): partial(permuted, dims=tuple(dims)) if dims is not None else whole}


def _qkv_views(mapping, module) -> dict[str, View] | None:
    config = mapping._get_config(module)
    if getattr(config, "attention_output_gate", False):
        return None
    heads, groups = config.num_attention_heads, config.num_query_groups
    head_size = config.kv_channels or config.hidden_size // heads
    return {mapping.hf_param[part]: partial(qkv, groups=groups, per_group=heads // groups,
                                            head_size=head_size, part=part) for part in "qkv"}


def _gated_views(mapping, module) -> dict[str, View]:
    return {mapping.hf_param["gate"]: partial(half, index=0), mapping.hf_param["up"]: partial(half, index=1)}


_RECOGNISED: dict[type, Callable] = {}


def recognised() -> dict[type, Callable]:
    """Mapping class (exactly: a subclass may change values) -> (mapping, module) -> {hf_name: View}."""
    if not _RECOGNISED:
        from .. import compat
        compat.apply("bridge")
        pm = bridge_model.param_mapping()
        _RECOGNISED.update({pm.AutoMapping: _direct_views, pm.DirectMapping: _direct_views,
                            pm.ReplicatedMapping: _direct_views, pm.ColumnParallelMapping: _direct_views,
                            pm.RowParallelMapping: _direct_views, pm.QKVMapping: _qkv_views,
                            pm.GatedMLPMapping: _gated_views})
    return _RECOGNISED


def selects_rows(view: View, probe: torch.Tensor) -> bool:
    """Whether `view` of a [out, in] weight picks whole rows: then view(B) of B [out, rank] picks the same rows."""
    if probe.dim() != 2:
        return False
    try:
        return torch.equal(view(probe)[..., :1], view(probe[:, :1].contiguous()))
    except RuntimeError:   # a view that cannot take one column
        return False
