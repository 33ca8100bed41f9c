"""Megatron-Bridge without Transformer Engine: placeholders are temporary, fixes still needed."""
import importlib.util
import sys

from mfsdp_kit import compat
from mfsdp_kit.compat.patches import bridge
from tests.dist.launch import free_port


def test_bridge_imports_and_placeholders_are_gone():
    compat.apply("bridge")
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
    compat.apply("bridge")
    assert bridge.scatter_fix_still_needed(), "bridge makes TP splits contiguous now: drop the fix"


def test_a_load_draws_no_progress_bar(tmp_path, capsys):
    """A CPU load of the tiny model through the bridge prints no rich bar (on an engine it froze at 0 %)."""
    from mfsdp_kit.distributed import runtime
    from mfsdp_kit.config import EngineConfig
    from mfsdp_kit.models import hf
    from mfsdp_kit.models.tiny import tiny
    folder = tiny(tmp_path / "xs", size="xs")
    runtime.init(EngineConfig(), rank=0, world_size=1, master_port=free_port())
    try:
        model = hf.load(folder, EngineConfig(), wrap=False)
    finally:
        runtime.shutdown()
    out = capsys.readouterr()
    assert model.chunks and "Loading from" not in out.out + out.err, out
    assert bridge.registry.ACTIVE and any("load_weights_hf_to_megatron" in p.target and p.still_needed()
                                          for p in bridge.registry.ACTIVE)
