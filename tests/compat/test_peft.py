"""Megatron-Bridge's LoRA without Transformer Engine: the HAVE_TE correction is still needed, and applied."""
import pytest

from mfsdp_kit import compat
from mfsdp_kit.compat.patches import bridge, peft


def test_bridge_peft_have_te_fix_still_needed():
    compat.apply("bridge")
    from megatron.core.extensions import transformer_engine as te
    if te.HAVE_TE:
        pytest.skip("Transformer Engine is installed: the bridge's flag is right")
    compat.apply("peft")
    assert peft.still_needed(), "the bridge's PEFT utils see that TE is absent now: delete compat/patches/peft.py"
    from megatron.bridge.peft import utils
    assert utils.HAVE_TE is False
    assert any(p.target == "megatron.bridge.peft.utils" for p in bridge.registry.ACTIVE)
