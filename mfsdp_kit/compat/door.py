"""`compat.apply(feature, **objects)`: the one way the kit turns on a patch of upstream code.

A patch changes code the kit does not own: a megatron / bridge module attribute or class method replaced for the
whole process, an instance method of one upstream object replaced, or a process-wide setting of torch or Python
(an environment variable torch reads, a warnings filter). Before this door, patches were turned on from a dozen
modules by two verbs (`enable`, `install`), so nobody could list from one file what a process may change. Now each patch
module (`compat/patches/`) keeps its turn-on function private, `FEATURES` names them all, and `apply` is the
only caller (tests/test_layout.py checks that nothing else calls them, and that `compat/access/` only reads).
Every feature records its `registry` row(s) when it changes something, as before.

`FEATURES` is resolved lazily (module paths as strings): `import mfsdp_kit.compat` imports neither megatron nor a
patch module, so a process that only imports the kit gets torch and megatron as they ship (tests/compat/
test_startup.py). compat imports nothing of the kit: a patch that installs the kit's own code (its RoPE, SwiGLU or
loss kernels) is handed it by the caller as an object (`compat.apply("rope", slots=...)`).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Feature:
    """One patch (or bundle of patches) `apply` can turn on."""

    target: str
    """`module:function` under mfsdp_kit.compat.patches: the private function that applies it."""
    scope: str
    """"process" (a module, class or setting changed for every object of the process) or "object" (one upstream
    object's method replaced; `apply` then takes that object as a keyword)."""
    what: str
    """What it changes and why, in one line; the module docstring and its registry row say more."""


_P = "mfsdp_kit.compat.patches"

FEATURES: dict[str, Feature] = {
    # process-wide, made first by runtime.init / an engine's boot (compat.patches.startup)
    "startup": Feature(f"{_P}.startup:_install", "process", "the four below that must precede megatron's import"),
    "lazy_compile": Feature(f"{_P}.lazy_compile:_install", "process", "megatron's fusions compile at first call"),
    "lazy_cpp_extension": Feature(f"{_P}.lazy_cpp_extension:_install", "process",
                                  "megatron imports torch.utils.cpp_extension when an allocator is built"),
    "inductor_cache": Feature(f"{_P}.inductor_cache:_install", "process",
                              "one torch.compile cache per forced ATEN_CPU_CAPABILITY (TORCHINDUCTOR_CACHE_DIR)"),
    "quiet": Feature(f"{_P}.quiet:_install", "process", "warnings filters for the benign messages of quiet.KNOWN"),
    # process-wide, made by runtime.init
    "no_te": Feature(f"{_P}.no_te:_enable", "process", "Megatron-FSDP's TELinear check without TE"),
    "fsdp_grads": Feature(f"{_P}.fsdp_grads:_enable", "process", "no 2x grads in one-rank FSDP groups"),
    "grad_norm": Feature(f"{_P}.grad_norm:_enable", "process", "clip_grads' fallbacks without a sync per tensor"),
    "grad_norm_on_device": Feature(f"{_P}.grad_norm:_enable_on_device", "process",
                                   "the norm and the clip test kept on the device"),
    "cpu": Feature(f"{_P}.cpu:_enable", "process", "megatron's CUDA assumptions answered on a CPU-only build"),
    # process-wide, made where the bridge, LoRA or a MoE model is first used
    "bridge": Feature(f"{_P}.bridge:_import_bridge", "process",
                      "megatron.bridge imported without TE / triton, its conversion fixes applied; returns it"),
    "moe_without_te": Feature(f"{_P}.bridge:_define_moe_te_names", "process",
                              "moe_utils' TE kernel names defined as None"),
    "bridge_mappings": Feature(f"{_P}.bridge:_add_mappings", "process",
                               "architecture=, mappings=: weight mappings one architecture's bridge lacks"),
    "experts": Feature(f"{_P}.experts:_enable", "process", "SequentialMLP expert numbers under EP (the bridge)"),
    "peft": Feature(f"{_P}.peft:_enable", "process", "the bridge's LoRA told that TE is absent"),
    "fsdp_frozen": Feature(f"{_P}.fsdp_frozen:_enable", "process", "Megatron-FSDP wraps frozen params"),
    "rope": Feature(f"{_P}.rope:_install", "process",
                    "slots=: megatron's empty fused-RoPE slots filled with the kit's pair (fused_kernels)"),
    "swiglu": Feature(f"{_P}.swiglu:_install", "process",
                      "kernel=: the MLP's fused SwiGLU in the kit's Triton kernel, None: megatron's (fusion_kernels)"),
    # one upstream object each
    "cross_entropy": Feature(f"{_P}.cross_entropy:_install", "object",
                             "model=, loss=: a LanguageModule's loss from its logits' dtype (fused_cross_entropy)"),
    "critic_values": Feature(f"{_P}.value_loss:_install", "object",
                             "model=: a GPTModel's per-token output is its value head's (rl.critic)"),
    "keep_gathered": Feature(f"{_P}.fsdp_gather_hold:_install", "object",
                             "pipeline=: an AllGatherPipeline's releases skipped while held (fsdp_keep_gathered)"),
    "defer_main_grads": Feature(f"{_P}.main_grads:_defer", "object",
                                "buffer=: a ParamAndGradBuffer's end-of-backward fp32 copies skipped (grad_upcast)"),
    "grads_for_norm": Feature(f"{_P}.main_grads:_replace_grads_for_norm", "object",
                              "optimizer=, fn=: one megatron optimizer's grads for the norm (grad_upcast)"),
    "hf_load_hook": Feature(f"{_P}.bridge_load:_load_weights", "object",
                            "bridge=, chunks=, modify=: a load whose HF tensors pass through modify (models.vocab)"),
}
"""Every patch the kit can turn on, by name."""


def apply(feature: str, **objects):
    """Turn on `feature` (a key of FEATURES), passing `objects` (keywords) to its patch; returns what the patch
    returns (whether it changed something, mostly). Idempotent: a feature already on (in this process, or on
    this object) changes nothing again. Unknown names raise ValueError naming the allowed ones."""
    row = FEATURES.get(feature)
    if row is None:
        raise ValueError(f"feature={feature!r} is not allowed; allowed: {' | '.join(FEATURES)}")
    module, _, function = row.target.partition(":")
    return getattr(importlib.import_module(module), function)(**objects)


def describe() -> str:
    """One line per feature: name, scope, what it changes."""
    return "\n".join(f"{name:20} {f.scope:8} {f.what}" for name, f in FEATURES.items())
