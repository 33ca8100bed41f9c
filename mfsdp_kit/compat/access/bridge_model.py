"""Megatron-Bridge's internals the kit reads (its one instance patch of the model bridge: patches/bridge_load.py).

`AutoBridge` (the bridge's front door) is public; behind it, each architecture's `MegatronModelBridge`
(`bridge._model_bridge`, a fresh instance per access) holds the HF <-> megatron mapping registry, builds the
conversion tasks and loads HF tensors (megatron/bridge/models/conversion/model_bridge.py). The kit reads those,
the mapping classes (param_mapping.py), the providers' layer specs and LoRA: every such access is here (the door,
docs/design.md), beside `compat.patches.bridge` (what makes the bridge import and convert without TE).
"""
from __future__ import annotations

import sys
from typing import Callable


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


def param_mapping():
    """The bridge's mapping classes module (AutoMapping, QKVMapping, GatedMLPMapping, ...)."""
    from megatron.bridge.models.conversion import param_mapping as pm
    return pm


def layer_specs() -> tuple[Callable, Callable]:
    """The GPT provider's (local_layer_spec, transformer_engine_layer_spec)."""
    from megatron.bridge.models.gpt_provider import local_layer_spec, transformer_engine_layer_spec
    return local_layer_spec, transformer_engine_layer_spec


def bridge_class(architecture: str) -> type:
    """The `MegatronModelBridge` subclass Megatron-Bridge registered for an HF architecture (its class name)."""
    import transformers
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge
    return type(get_model_bridge(getattr(transformers, architecture)))


def local_attention_module(bridge_spec) -> type:
    """The self-attention class an architecture's bridge layer spec (a function of its provider module) puts in
    place of megatron's: the one `SelfAttention` subclass that module defines (OLMoE's QK norm over all heads,
    `olmoe_provider.OLMoESelfAttention`). For the families whose spec says it has one (`Bridge.local_attention`)."""
    from megatron.core.transformer.attention import SelfAttention
    module = sys.modules[bridge_spec.__module__]
    found = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, SelfAttention)
             and c.__module__ == module.__name__]
    if len(found) != 1:
        raise LookupError(f"{module.__name__} defines {len(found)} SelfAttention classes, not one: {found}")
    return found[0]


def lora_class() -> type:
    """The bridge's PEFT `LoRA` transform."""
    from megatron.bridge.peft.lora import LoRA
    return LoRA
