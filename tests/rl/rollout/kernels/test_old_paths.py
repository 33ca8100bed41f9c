"""rl.rollout.kernels' modules at their old paths (`rl.rollout.attention`, ...): each imports, warns once that it is
deprecated naming the new path and the release that removes it, and gives the very objects of the new module."""
import importlib

import pytest

from mfsdp_kit.config.flat import REMOVED_IN


@pytest.mark.parametrize("name", ["attention", "elementwise", "sampling", "draw"])
def test_an_old_kernel_path_imports_the_new_module_with_a_warning(name):
    new = importlib.import_module(f"mfsdp_kit.rl.rollout.kernels.{name}")
    with pytest.warns(DeprecationWarning, match=rf"rl\.rollout\.{name} is deprecated: import "
                                                rf"mfsdp_kit\.rl\.rollout\.kernels\.{name} .*{REMOVED_IN}"):
        old = importlib.reload(importlib.import_module(f"mfsdp_kit.rl.rollout.{name}"))   # reload: warn again here
    public = [n for n in vars(new) if not n.startswith("_")]
    assert public and all(getattr(old, n) is getattr(new, n) for n in public), name
