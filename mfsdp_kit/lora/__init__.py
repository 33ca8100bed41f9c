"""LoRA adapters on the megatron model, through Megatron-Bridge's PEFT (`megatron.bridge.peft.lora.LoRA`).

The naive way - freeze the wrapped model and hand the optimizer the adapters - fails under both wrappers:
DDP and Megatron-FSDP lay out their grad buffers (and Megatron-FSDP its fp32 main-weight shards) when they
wrap, from each parameter's `requires_grad` at that moment. So `apply` runs on the plain chunks, after the
HF weights are loaded and before `engine.wrap_chunks`: the bridge's `PEFT.__call__` sets every existing
parameter's `requires_grad=False` (peft/base.py `freeze_model`) and replaces each targeted linear with
`LoRALinear(base, ParallelLinearAdapter)`, whose A (rank x in, "xavier") and B (out x rank, zeros) are
the only trainable parameters; B = 0 makes the first forward the base model's.

What the wrappers then do with the frozen base (megatron-core 0.16.1):
- DDP: no grad buffer for them (distributed_data_parallel.py:112 `if not param.requires_grad: continue`).
- The optimizer collects only `requires_grad` params (optimizer/__init__.py:147): Adam state for adapters only.
- Megatron-FSDP shards the frozen base like any weight but gives it no grad buffer, no fp32 main weights and
  no optimizer state (param_and_grad_buffer.py:1378 groups params by `requires_grad`, :1965 makes grad and
  main-weight buffers for groups with grads only). Its wrap alone fails on frozen params, a grad hook torch
  refuses (megatron_fsdp.py:1007-1012): `compat.patches.fsdp_frozen`, enabled by `apply`, registers none for them.

Megatron fuses what HF keeps apart: q/k/v are one `linear_qkv`, gate/up one `linear_fc1`. One adapter on a
fused linear shares its A over the fused outputs (rank r for q, k and v together), so HF names are accepted
only as whole fused groups (q_proj with k_proj and v_proj), never one of them alone.

Where the pieces live (imports point down: docs/design.md, "Layers"): `LoRAConfig` is a section of `EngineConfig`
(`config.sections`); putting the adapters on is `distributed.engine.add_adapters`, because `engine.build` and
`models.hf.load` do it before their wrap; an HF base's fingerprint is `models.hf.base_reference`, which `load` keeps
on the chunks. This package is where a user finds all of it (`lora.LoRAConfig`, `lora.apply`, ...), and holds what
is asked of adapted chunks afterwards; `adapters` writes them for HF `peft`.
"""
from __future__ import annotations

from ..config.sections import HF_TO_MEGATRON, MEGATRON_TARGETS, LoRAConfig  # noqa: F401 (the names users type)
from ..config.sections import check_lora as check  # noqa: F401


def apply(chunks: list, *, lora: LoRAConfig, base_path=None) -> list:
    """Adapters into the plain (unwrapped) `chunks`, every other parameter frozen; returns `chunks`.

    Call before wrapping (module docstring: the wrappers lay out their buffers from `requires_grad`).
    `base_path`: the HF folder the frozen weights came from; its `base_reference` is kept on the chunks
    (`base_of`), so checkpoints name their base and refuse another one."""
    from ..distributed.engine import add_adapters
    add_adapters(chunks, lora=lora)
    if base_path is not None:
        from ..models.hf import keep_base
        keep_base(chunks, base_path=base_path)
    return chunks


def has_adapters(chunks) -> bool:
    """Whether any chunk (wrapped or not) holds LoRA adapters."""
    return any(is_adapter(name) for chunk in chunks for name, _ in chunk.named_parameters())


def base_of(chunks) -> dict | None:
    """The `base_reference` `apply` (or `models.hf.load`: `models.hf.keep_base`) kept on these chunks (wrapped or
    not), or None (no LoRA, or no base path)."""
    for module in list(chunks)[:1]:
        while not hasattr(module, "mfsdp_lora_base") and hasattr(module, "module"):   # through the wrappers
            module = module.module
        return getattr(module, "mfsdp_lora_base", None)
    return None


def base_reference(*, base_path) -> dict:
    """{"path": absolute folder, "fingerprint": sha256 hex} of an HF base folder: `models.hf.base_reference`, which
    says what the fingerprint reads (imported at the call: this package imports no model code at import)."""
    from ..models.hf import base_reference as reference
    return reference(base_path=base_path)


def __getattr__(name: str):
    """`lora.FINGERPRINT_BLOCK_BYTES`, now `models.hf`'s, served from there on first use (as `base_reference`)."""
    if name == "FINGERPRINT_BLOCK_BYTES":
        from ..models.hf import FINGERPRINT_BLOCK_BYTES
        return FINGERPRINT_BLOCK_BYTES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_adapter(name: str) -> bool:
    """Whether a parameter name (wrapped or not) belongs to a LoRA adapter."""
    return ".adapter." in f".{name}"


def param_counts(chunks) -> dict:
    """{"trainable": adapter elements, "frozen": base elements} of the whole model (FSDP's DTensors report their
    global size; under TP, this rank's slice)."""
    counts = dict(trainable=0, frozen=0)
    for chunk in chunks:
        for p in chunk.parameters():
            counts["trainable" if p.requires_grad else "frozen"] += p.numel()
    return counts


def trainable_names(chunks: list) -> list[str]:
    """Names of the parameters with requires_grad, chunk by chunk."""
    return [name for chunk in chunks for name, p in chunk.named_parameters() if p.requires_grad]
