"""`compat.apply("rope", kernels=)`: megatron's fused-RoPE slots, empty without TE, filled with the kit's RoPE
(`models.fusions.rope` / `rope_thd`, their rotation compiled or in Triton per `kernels`; that module says why), a
module patch made by `fused_kernels`.
"""
from __future__ import annotations

from ..registry import Patch, record

PATCH = Patch(target="megatron.core.models.common.embeddings.rope_utils",
              upstream="megatron/core/models/common/embeddings/rope_utils.py:20-29 (both fused RoPE slots None "
                       "without TE), filled by compat.apply('rope')",
              needed_if="    fused_apply_rotary_pos_emb = None")
"""The module patch `_install` applies (a compat.registry row; tests/compat/test_instance_patches.py)."""


def _install(kernels: str = "torch") -> bool:
    """Fill megatron's fused-RoPE slots (padded and packed) with the kit's pair for `kernels` ("torch" | "triton",
    `models.fusions.ROPE_SLOTS`) when TE left them empty or the kit filled them before (the last call chooses);
    returns whether they now hold the kit's pair."""
    from megatron.core.models.common.embeddings import rope_utils
    from ...models.fusions import ROPE_SLOTS
    ours = [fn for pair in ROPE_SLOTS.values() for fn in pair]
    if rope_utils.fused_apply_rotary_pos_emb is not None and rope_utils.fused_apply_rotary_pos_emb not in ours:
        return False   # TE's kernel
    rope_utils.fused_apply_rotary_pos_emb, rope_utils.fused_apply_rotary_pos_emb_thd = ROPE_SLOTS[kernels]
    record(PATCH)
    return True
