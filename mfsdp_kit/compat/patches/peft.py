"""Megatron-Bridge 0.3.1's LoRA without Transformer Engine.

megatron/bridge/peft/utils.py:37-62 imports TE's linears from megatron.core.extensions.transformer_engine
with `safe_import_from`, which succeeds without TE: that module defines the names anyway (as MagicMock
objects or None), so the bridge's `HAVE_TE` is True. utils.py:129 then calls `isinstance(m, <MagicMock>)`
on every linear LoRA adapts: a TypeError. Setting the bridge's flag to megatron-core's own `HAVE_TE`
(False) sends the local spec's Column/RowParallelLinear to their branches (utils.py:166-173).
Delete when `still_needed()` is False.
"""
from __future__ import annotations

from .. import registry

UPSTREAM = "megatron/bridge/peft/utils.py:37-62,129 (HAVE_TE True without TE: isinstance of a MagicMock)"


def still_needed() -> bool:
    """True while the bridge's PEFT utils think TE is there when megatron-core knows it is not."""
    from megatron.bridge.peft import utils
    from megatron.core.extensions import transformer_engine as te
    original = getattr(utils, "_mfsdp_kit_original_HAVE_TE", utils.HAVE_TE)
    return bool(original) and not te.HAVE_TE


def _enable() -> bool:
    """Correct the flag where TE is absent; returns whether it did."""
    from megatron.bridge.peft import utils
    if not still_needed() or hasattr(utils, "_mfsdp_kit_original_HAVE_TE"):
        return False
    utils._mfsdp_kit_original_HAVE_TE = utils.HAVE_TE
    utils.HAVE_TE = False
    registry.record(registry.Patch(target="megatron.bridge.peft.utils", package="megatron-bridge",
                                   upstream=UPSTREAM, needed_if=still_needed))
    return True
