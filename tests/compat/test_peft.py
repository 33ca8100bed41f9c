"""Megatron-Bridge's LoRA without Transformer Engine: the HAVE_TE correction is still needed, and applied."""
import pytest

from mfsdp_kit.compat import bridge, peft


def test_bridge_peft_have_te_fix_still_needed():
    bridge.import_bridge()
    from megatron.core.extensions import transformer_engine as te
    if te.HAVE_TE:
        pytest.skip("Transformer Engine is installed: the bridge's flag is right")
    peft.enable()
    assert peft.still_needed(), "the bridge's PEFT utils see that TE is absent now: delete compat/peft.py"
    from megatron.bridge.peft import utils
    assert utils.HAVE_TE is False
    assert any(p.target == "megatron.bridge.peft.utils" for p in bridge.registry.ACTIVE)
