"""`compat.apply("rope", slots=)`: megatron's fused-RoPE slots, empty without TE, filled with the caller's pair (the
kit's `models.fusions.rope` / `rope_thd`, their rotation compiled or in Triton: `models.fusions.ROPE_SLOTS`; that
module says why), a module patch made by `fused_kernels`. The caller hands the functions in: compat imports nothing
of the kit.
"""
from __future__ import annotations

from typing import Callable

from ..registry import Patch, record

PATCH = Patch(target="megatron.core.models.common.embeddings.rope_utils",
              upstream="megatron/core/models/common/embeddings/rope_utils.py:20-29 (both fused RoPE slots None "
                       "without TE), filled by compat.apply('rope')",
              needed_if="    fused_apply_rotary_pos_emb = None")
"""The module patch `_install` applies (a compat.registry row; tests/compat/test_instance_patches.py)."""

_FILLED: set[Callable] = set()
"""Every function this patch has put in a slot: a slot holding another one holds TE's kernel."""


def _install(*, slots: tuple[Callable, Callable]) -> bool:
    """Fill megatron's fused-RoPE slots with `slots` (padded, packed: `fused_apply_rotary_pos_emb`,
    `fused_apply_rotary_pos_emb_thd`) when TE left them empty or this patch filled them before (the last call
    chooses); returns whether they now hold `slots`."""
    from megatron.core.models.common.embeddings import rope_utils
    if rope_utils.fused_apply_rotary_pos_emb is not None and rope_utils.fused_apply_rotary_pos_emb not in _FILLED:
        return False   # TE's kernel
    rope_utils.fused_apply_rotary_pos_emb, rope_utils.fused_apply_rotary_pos_emb_thd = slots
    _FILLED.update(slots)
    record(PATCH)
    return True
