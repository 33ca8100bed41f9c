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
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..fieldtypes import bad_value, check_field_types, finite

MEGATRON_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The dense linears of a megatron GPT layer LoRA can adapt."""
HF_TO_MEGATRON = dict(q_proj="linear_qkv", k_proj="linear_qkv", v_proj="linear_qkv", o_proj="linear_proj",
                      gate_proj="linear_fc1", up_proj="linear_fc1", down_proj="linear_fc2")
"""HF (Llama/Qwen) module names -> the megatron linear holding them."""


@dataclass(kw_only=True)
class LoRAConfig:
    """Low-rank adapters: W x + (alpha / rank) * B A x, with only A and B trained."""

    rank: int = 8
    """Inner dimension r of A (r x in) and B (out x r); the bridge's `dim`."""
    alpha: int = 16
    """Scale numerator: the adapter's output is multiplied by alpha / rank (the bridge takes an int)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (the bridge's dropout_position "pre"), in [0, 1)."""
    target_modules: list = field(default_factory=lambda: list(MEGATRON_TARGETS))
    """Linears to adapt: megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2) or HF names
    (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; fused ones as whole groups)."""

    def __post_init__(self):
        self.validate()

    def validate(self) -> "LoRAConfig":
        """Raise `ConfigError` naming the bad field, its value and what is allowed."""
        check_field_types(self)
        if self.rank < 1:
            raise bad_value("lora.rank", self.rank, "an integer >= 1")
        if self.alpha < 1:
            raise bad_value("lora.alpha", self.alpha, "an integer >= 1")
        if not (finite(self.dropout) and 0 <= self.dropout < 1):
            raise bad_value("lora.dropout", self.dropout, "a number in [0, 1)")
        names = MEGATRON_TARGETS + tuple(HF_TO_MEGATRON)
        for name in self.target_modules:
            if name not in names:
                raise bad_value("lora.target_modules", self.target_modules, f"a non-empty list of {' | '.join(names)}")
        if not self.target_modules:
            raise bad_value("lora.target_modules", self.target_modules, f"a non-empty list of {' | '.join(names)}")
        for fused in MEGATRON_TARGETS:
            group = sorted(hf for hf, m in HF_TO_MEGATRON.items() if m == fused)
            given = sorted(set(group) & set(self.target_modules))
            if given and given != group:
                raise bad_value("lora.target_modules", self.target_modules,
                                f"all of {group} or none: megatron fuses them into {fused}, one adapter for all")
        return self

    def megatron_targets(self) -> list[str]:
        """The megatron linear names the targets map to, each once, in megatron's layer order."""
        wanted = {HF_TO_MEGATRON.get(name, name) for name in self.target_modules}
        return [name for name in MEGATRON_TARGETS if name in wanted]


def check(*, lora) -> None:
    """`EngineConfig.lora`: None or a valid `LoRAConfig`."""
    if lora is not None and not isinstance(lora, LoRAConfig):
        raise bad_value("lora", lora, "None | LoRAConfig(rank=..., alpha=..., dropout=..., target_modules=[...])")
    if lora is not None:
        lora.validate()


def apply(chunks: list, *, lora: LoRAConfig, base_path=None) -> list:
    """Adapters into the plain (unwrapped) `chunks`, every other parameter frozen; returns `chunks`.

    Call before wrapping (module docstring: the wrappers lay out their buffers from `requires_grad`).
    `base_path`: the HF folder the frozen weights came from; its `base_reference` is kept on the chunks
    (`base_of`), so checkpoints name their base and refuse another one."""
    from .. import compat
    from ..compat.access import bridge_model
    compat.apply("bridge")
    compat.apply("peft")
    compat.apply("fsdp_frozen")   # for a later Megatron-FSDP wrap
    LoRA = bridge_model.lora_class()
    lora.validate()
    peft = LoRA(target_modules=lora.megatron_targets(), dim=lora.rank, alpha=lora.alpha, dropout=lora.dropout)
    peft(chunks, training=True)
    if base_path is not None:
        reference = base_reference(base_path=base_path)
        for chunk in chunks:
            chunk.mfsdp_lora_base = reference
    return chunks


def has_adapters(chunks) -> bool:
    """Whether any chunk (wrapped or not) holds LoRA adapters."""
    return any(is_adapter(name) for chunk in chunks for name, _ in chunk.named_parameters())


def base_of(chunks) -> dict | None:
    """The `base_reference` `apply` kept on these chunks (wrapped or not), or None (no LoRA, or no base path)."""
    for module in list(chunks)[:1]:
        while not hasattr(module, "mfsdp_lora_base") and hasattr(module, "module"):   # through the wrappers
            module = module.module
        return getattr(module, "mfsdp_lora_base", None)
    return None


FINGERPRINT_BLOCK_BYTES = 1 << 20
"""Bytes read from each of a safetensors file's first, middle and last block (1 MiB each)."""


def base_reference(*, base_path) -> dict:
    """{"path": absolute folder, "fingerprint": sha256 hex} of an HF base folder.

    The fingerprint hashes config.json and, per *.safetensors file (in name order), its name, size, header (every
    tensor's name, dtype, shape and offsets) and three 1 MiB blocks of its data: 3 MiB read per file, not the
    whole model (14 GB at 7 B), yet any other model (another fine-tune of the same shapes included) differs in
    those blocks. A base copied elsewhere keeps its fingerprint; its path is only a hint to the reader."""
    path = Path(base_path).resolve()
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        with open(file, "rb") as f:
            header = int.from_bytes(f.read(8), "little")
            digest.update(json.dumps([file.name, size]).encode() + f.read(header))
            for start in sorted({8 + header, max(8 + header, size // 2), max(8 + header, size - FINGERPRINT_BLOCK_BYTES)}):
                f.seek(start)
                digest.update(f.read(FINGERPRINT_BLOCK_BYTES))
    return dict(path=str(path), fingerprint=digest.hexdigest())


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
