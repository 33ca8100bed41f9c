"""The model bridge's one instance patch: a load whose HF tensors pass through the kit's `modify` (models.vocab).

`compat.apply("hf_load_hook", bridge=, chunks=, modify=)` is an instance patch and the load it serves, in one call:
model_bridge.py:765 reads every HF tensor through `maybe_modify_loaded_hf_weight` (line 654, which returns it as
stored), and the bridge cannot pad a vocabulary for TP (`models.vocab`). The patch lives on the fresh model bridge
`access.bridge_model.model_bridge` returns for this load only, so nothing else sees it. It is a registry row;
tests/compat/test_instance_patches.py says when it is not needed.
"""
from __future__ import annotations

from typing import Callable

from ..access.bridge_model import model_bridge
from ..registry import Patch, record

LOAD_HOOK = Patch(
    target="megatron.bridge.models.conversion.model_bridge:MegatronModelBridge.maybe_modify_loaded_hf_weight",
    upstream="megatron/bridge/models/conversion/model_bridge.py:654-675 (HF tensors loaded as stored, no "
             "vocabulary padding; read at line 765), instance patch per load",
    needed_if="hf_weights = hf_state_dict[hf_param]", package="megatron-bridge")


def _load_weights(*, bridge, chunks, modify: Callable) -> None:
    """`bridge.load_hf_weights(chunks)` with each HF tensor passed through `modify(hf_param, weights)`."""
    mb = model_bridge(bridge)   # keep this instance: the patch lives on it
    original = mb.maybe_modify_loaded_hf_weight

    def modified(hf_param, hf_state_dict):
        return modify(hf_param, original(hf_param, hf_state_dict))

    mb.maybe_modify_loaded_hf_weight = modified
    record(LOAD_HOOK)
    mb.load_weights_hf_to_megatron(bridge.hf_pretrained, chunks)
