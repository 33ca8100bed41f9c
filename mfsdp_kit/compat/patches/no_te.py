"""Megatron-Core 0.16.1 without Transformer Engine (CPU machines, and GPU images without TE).

megatron/core/distributed/fsdp/mcore_fsdp_adapter.py:41 imports `TELinear`, which is None when
TE is absent, and :184 calls `isinstance(module, (TELinear,))` for every parameter when TP > 1:
a TypeError. A class nothing is an instance of keeps the check meaningful (no TE module can be
there) and lets Megatron-FSDP wrap tensor-parallel models. Delete when `still_needed()` is False.
"""
from __future__ import annotations

from .. import registry

UPSTREAM = "megatron/core/distributed/fsdp/mcore_fsdp_adapter.py:41,184"


class _NoTELinear:
    """Stands for TE's Linear when TE is not installed: no module is an instance of it."""


def still_needed() -> bool:
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter
    original = getattr(adapter, "_mfsdp_kit_original_TELinear", adapter.TELinear)
    return not isinstance(original, type)


def _enable() -> bool:
    """Install the placeholder when TE is absent; returns whether it did."""
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter
    if isinstance(adapter.TELinear, type):
        return False
    adapter._mfsdp_kit_original_TELinear = adapter.TELinear
    adapter.TELinear = _NoTELinear
    registry.record(registry.Patch(target="megatron.core.distributed.fsdp.mcore_fsdp_adapter:TELinear",
                                   upstream=UPSTREAM, needed_if=still_needed))
    return True
