"""`compat.apply("rope")`: megatron's fused-RoPE slots, empty without TE, filled with the kit's compiled RoPE
(`models.fusions.rope` / `rope_thd`; that module says why), a module patch made by `fused_kernels`.
"""
from __future__ import annotations

from ..registry import Patch, record

PATCH = Patch(target="megatron.core.models.common.embeddings.rope_utils",
              upstream="megatron/core/models/common/embeddings/rope_utils.py:20-29 (both fused RoPE slots None "
                       "without TE), filled by compat.apply('rope')",
              needed_if="    fused_apply_rotary_pos_emb = None")
"""The module patch `_install` applies (a compat.registry row; tests/compat/test_instance_patches.py)."""


def _install() -> bool:
    """Fill megatron's fused-RoPE slots (padded and packed) with `rope` and `rope_thd` when TE left them
    empty; returns whether it did."""
    from megatron.core.models.common.embeddings import rope_utils
    from ...models.fusions import rope, rope_thd
    if rope_utils.fused_apply_rotary_pos_emb is not None:
        return rope_utils.fused_apply_rotary_pos_emb is rope
    rope_utils.fused_apply_rotary_pos_emb = rope
    rope_utils.fused_apply_rotary_pos_emb_thd = rope_thd
    record(PATCH)
    return True
