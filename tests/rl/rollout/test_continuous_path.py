"""rl.rollout.continuous, the engine's old module path: it imports, warns once naming the new path and the release
that removes it, and gives the engine's own classes."""
import importlib

import pytest

from mfsdp_kit.config.flat import REMOVED_IN
from mfsdp_kit.rl.rollout import engine


def test_the_old_engine_path_imports_the_engine_with_a_warning():
    with pytest.warns(DeprecationWarning, match=rf"rl\.rollout\.continuous is deprecated: .*rl\.rollout\.engine.*"
                                                rf"{REMOVED_IN}"):
        old = importlib.reload(importlib.import_module("mfsdp_kit.rl.rollout.continuous"))
    assert old.ContinuousRollout is engine.ContinuousRollout and old.DecodeConfig is engine.DecodeConfig
