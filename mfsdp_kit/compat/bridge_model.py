"""Megatron-Bridge's internals the kit reads, and its one instance patch of the model bridge.

`AutoBridge` (the bridge's front door) is public; behind it, each architecture's `MegatronModelBridge`
(`bridge._model_bridge`, a fresh instance per access) holds the HF <-> megatron mapping registry, builds the
conversion tasks and loads HF tensors (megatron/bridge/models/conversion/model_bridge.py). The kit reads those,
the mapping classes (param_mapping.py), the providers' layer specs and LoRA: every such access is here (the door,
docs/design.md), beside `compat.bridge` (what makes the bridge import and convert without TE).

`load_weights(..., modify=)` is an instance patch: model_bridge.py:765 reads every HF tensor through
`maybe_modify_loaded_hf_weight` (line 654, which returns it as stored), and the bridge cannot pad a vocabulary
for TP (`models.vocab`). It is a registry row; tests/compat/test_instance_patches.py says when it is not needed.
"""
from __future__ import annotations

from typing import Callable

from .registry import Patch, record

LOAD_HOOK = Patch(
    target="megatron.bridge.models.conversion.model_bridge:MegatronModelBridge.maybe_modify_loaded_hf_weight",
    upstream="megatron/bridge/models/conversion/model_bridge.py:654-675 (HF tensors loaded as stored, no "
             "vocabulary padding; read at line 765), instance patch per load",
    needed_if="hf_weights = hf_state_dict[hf_param]", package="megatron-bridge")


def model_bridge(bridge):
    """The architecture's model bridge behind an AutoBridge (a fresh instance each call)."""
    return bridge._model_bridge


def hf_names(bridge, *, megatron_params: tuple[str, ...]) -> set[str]:
    """HF names that the bridge maps one-to-one onto any of `megatron_params` (megatron names)."""
    names = set()
    for mapping in model_bridge(bridge).mapping_registry().mappings:
        if mapping.megatron_param in megatron_params and isinstance(mapping.hf_param, str):
            names.add(mapping.hf_param)
    return names


def conversion_tasks(bridge, models: list) -> list:
    """The bridge's conversion tasks for unwrapped megatron `models`, in model order (call in the compute view)."""
    return model_bridge(bridge).build_conversion_tasks(bridge.hf_pretrained, models)


def load_weights(bridge, chunks, *, modify: Callable) -> None:
    """`bridge.load_hf_weights(chunks)` with each HF tensor passed through `modify(hf_param, weights)`."""
    mb = model_bridge(bridge)   # keep this instance: the patch lives on it
    original = mb.maybe_modify_loaded_hf_weight

    def modified(hf_param, hf_state_dict):
        return modify(hf_param, original(hf_param, hf_state_dict))

    mb.maybe_modify_loaded_hf_weight = modified
    record(LOAD_HOOK)
    mb.load_weights_hf_to_megatron(bridge.hf_pretrained, chunks)


def param_mapping():
    """The bridge's mapping classes module (AutoMapping, QKVMapping, GatedMLPMapping, ...)."""
    from megatron.bridge.models.conversion import param_mapping as pm
    return pm


def layer_specs() -> tuple[Callable, Callable]:
    """The GPT provider's (local_layer_spec, transformer_engine_layer_spec)."""
    from megatron.bridge.models.gpt_provider import local_layer_spec, transformer_engine_layer_spec
    return local_layer_spec, transformer_engine_layer_spec


def local_attention_module(bridge_spec):
    """The self-attention class an architecture's bridge spec puts in place of megatron's (or None): OLMoE's
    QK norm over all heads (`olmoe_provider.OLMoESelfAttention`)."""
    from megatron.bridge.models.olmoe.olmoe_provider import OLMoESelfAttention, olmoe_layer_spec
    return OLMoESelfAttention if bridge_spec is olmoe_layer_spec else None


def lora_class() -> type:
    """The bridge's PEFT `LoRA` transform."""
    from megatron.bridge.peft.lora import LoRA
    return LoRA
