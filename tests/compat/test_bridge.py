"""Megatron-Bridge without Transformer Engine: placeholders are temporary, fixes still needed."""
import importlib.util
import sys

from mfsdp_kit.compat import bridge


def test_bridge_imports_and_placeholders_are_gone():
    bridge.import_bridge()
    from megatron.bridge import AutoBridge  # noqa: F401
    for name in ("transformer_engine", "triton"):
        module = sys.modules.get(name)
        assert module is None or not getattr(module, bridge.PLACEHOLDER, False), f"{name} placeholder leaked"


def test_placeholders_never_shadow_a_real_install():
    with bridge.placeholders() as added:
        for name in ("transformer_engine", "triton"):
            real = importlib.util.find_spec(name) is not None if name not in added else False
            assert (name in added) != real or name not in added


def test_placeholders_still_needed():
    assert bridge.placeholders_still_needed(), "bridge imports TE lazily now: drop the TE placeholder"


def test_tp_scatter_fix_still_needed():
    bridge.import_bridge()
    assert bridge.scatter_fix_still_needed(), "bridge makes TP splits contiguous now: drop the fix"
