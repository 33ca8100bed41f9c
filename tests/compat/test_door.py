"""compat.apply: the one door for patches. Every feature names a patch function that exists, an unknown name is
refused with the allowed ones, and a feature applied twice changes nothing the second time."""
import importlib

import pytest

from mfsdp_kit import compat
from mfsdp_kit.compat import registry


def test_every_feature_resolves_to_a_private_patch_function():
    for name, feature in compat.FEATURES.items():
        module, _, function = feature.target.partition(":")
        assert module.startswith("mfsdp_kit.compat.patches.") and function.startswith("_"), name
        assert callable(getattr(importlib.import_module(module), function)), name
        assert feature.scope in ("process", "object") and feature.what, name


def test_an_unknown_feature_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"feature='nope' is not allowed; allowed: startup \| .*\| hf_load_hook"):
        compat.apply("nope")


def test_applying_twice_changes_nothing_more():
    compat.apply("startup")
    compat.apply("no_te")
    before = list(registry.ACTIVE)
    compat.apply("startup")
    compat.apply("no_te")
    assert registry.ACTIVE == before
