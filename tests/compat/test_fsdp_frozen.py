"""Megatron-FSDP's wrap of frozen params: the patch is still needed (tests/lora/test_lora.py shows it works)."""
from mfsdp_kit import compat
from mfsdp_kit.compat.patches import fsdp_frozen


def test_fsdp_frozen_hook_fix_still_needed():
    compat.apply("fsdp_frozen")
    assert fsdp_frozen.still_needed(), ("Megatron-FSDP skips frozen params' grad hooks now: delete "
                                        "compat/patches/fsdp_frozen.py and its enable() in lora.apply")
    assert any(p.target == fsdp_frozen.TARGET for p in fsdp_frozen.registry.ACTIVE)
