"""What the kit knows about one HF model family, as data: `ArchSpec` (a family that works), `Refused` (one refused by
name, with the reason), and the pieces a spec holds for the loader's bridge (`Bridge`) and the rollout's decoder
(`Decoder`).

A spec is read by the code that acts on it, which names no architecture: `models.support.check_config` (the
loader's field rules), `models.hf` (the bridge fixes, handed to `compat.apply`), `rl.rollout.decoder` (the decoder's
hooks) and the tiny writer (`models.archs.write_tiny`). So adding a family is one file in `models/archs/` holding
one `SPEC` (docs/design.md, "Where does a new X go").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ...fieldtypes import ConfigError, bad_value

BASE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=False,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
"""Shapes every tiny model shares (a spec's `tiny` adds its family's own): two layers, hidden 64, 4 heads / 2 KV heads,
seconds on CPU."""

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
"""The tiny MoE shape: 4 experts, 2 per token."""

QK_NORMS = (None, "head", "heads")


@dataclass(frozen=True, kw_only=True)
class Bridge:
    """What Megatron-Bridge 0.3.1's bridge of the family lacks without Transformer Engine; `models.hf` hands it to
    compat, which owns the patching (`compat.apply("bridge_mappings")`, `compat.access.bridge_model`)."""

    mappings: tuple[tuple[str, dict], ...] = ()
    """Weight mappings the bridge's mapping registry lacks, each (mapping class name in the bridge's
    param_mapping module, its keyword arguments), `*` standing for layer and expert numbers. Added to the
    registry, once a process, when a model of the family is loaded."""
    local_attention: bool = False
    """The bridge's layer spec puts a self-attention class of its own in place of megatron's (OLMoE's QK norm over
    all heads); the local (no-TE) layer spec the kit builds keeps that class."""


@dataclass(frozen=True, kw_only=True)
class Decoder:
    """How the rollout engine's decoder (`rl.rollout.decoder`) computes a layer of the family: pre-norm attention
    with q/k/v/o projections (optional biases, found on the modules) and RoPE from the model's rotary module, then
    the MLP. Sliding windows need no hook: `decoder.layer_windows` reads them from the config (`sliding_window`,
    `use_sliding_window`, `layer_types`) the same way for every family."""

    qk_norm: str | None = None
    """Where the attention's `q_norm` / `k_norm` (RMSNorms) apply: None (there are none), "head" (over each
    head's head_dim values, after the split into heads), "heads" (over all heads' q, and all k, at once, before the
    split)."""
    moe: bool = False
    """The MLP is a routed mixture of experts: its HF block runs as it is (its router picks each token's experts),
    gate/up are not fused, and no CUDA graph captures the step (the tokens each expert gets depend on the data)."""

    def __post_init__(self):
        if self.qk_norm not in QK_NORMS:
            raise bad_value("Decoder.qk_norm", self.qk_norm, " | ".join(map(repr, QK_NORMS)))


@dataclass(frozen=True, kw_only=True)
class ArchSpec:
    """One HF model family the kit reproduces exactly (load -> wrap -> export, logits and greedy tokens equal to
    transformers': tests/models, tests/rl/rollout/test_engine.py), and what it takes to."""

    architecture: str
    """The HF model class, as config.json's `architectures` lists it (e.g. "LlamaForCausalLM")."""
    model_type: str
    """config.json's `model_type` (e.g. "llama")."""
    config_class: str
    """The transformers config class (`transformers.<config_class>`)."""
    tiny: dict = field(default_factory=dict)
    """The tiny model's config fields over `BASE` (`write_tiny`): what the family needs to stay tiny and still
    show what makes it differ (a head_dim other than hidden / heads, MoE sizes)."""
    rope_scaling: dict[str, dict[str, float]] = field(default_factory=dict)
    """`rope_scaling.rope_type`s the bridge maps onto megatron's RoPE scaling, each with the parameters megatron
    fixes (a config giving another value is refused); any other type but "default" is refused."""
    sliding_window: bool = False
    """The bridge maps `sliding_window` onto megatron's window (`support.megatron_window` makes it exact); else an
    active window is refused."""
    attention_bias: bool = False
    """The bridge maps `attention_bias` (q/k/v biases, no o_proj bias in HF); else it is refused."""
    no_tensor_parallel: str | None = None
    """Why tensor_model_parallel_size > 1 is refused for the family (None: TP works)."""
    check: Callable[[dict], None] | None = None
    """The family's own field rules: raises ConfigError (`refuse`) for a config.json field its bridge does not
    reproduce exactly. Runs after the rules every family shares (`support.check_config`)."""
    bridge: Bridge = field(default_factory=Bridge)
    """What its Megatron-Bridge bridge lacks without TE (`Bridge`)."""
    decoder: Decoder | None = field(default_factory=Decoder)
    """How the rollout engine computes its layers (`Decoder`); None: the engine does not run it (HFRollout does)."""

    def __post_init__(self):
        if not self.architecture.endswith("ForCausalLM"):
            raise bad_value("ArchSpec.architecture", self.architecture, "an HF causal LM class name (...ForCausalLM)")


@dataclass(frozen=True, kw_only=True)
class Refused:
    """An architecture Megatron-Bridge lists that this install refuses by name (`models.archs.refused`)."""

    architecture: str
    """The HF model class, as config.json's `architectures` lists it."""
    reason: str
    """Why it is refused: what it would need (the ConfigError's text)."""
    config_class: str | None = None
    """The transformers config class, where transformers can build it offline (None: a tiny config of it cannot be
    written; `check_folder` still refuses it by name)."""
    tiny: dict = field(default_factory=dict)
    """The tiny config's fields over `BASE` (`write_tiny`), for the tests that show it refused."""


def refuse(arch: str, field_name: str, value, allowed: str, reason: str) -> ConfigError:
    """The loader's message for a config.json field `arch` does not reproduce exactly: the field, its value, what
    is allowed, and why."""
    return ConfigError(f"{arch}: {field_name}={value!r} is not allowed; allowed: {allowed}. {reason}")
