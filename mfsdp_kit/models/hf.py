"""Hugging Face folders <-> Megatron chunks through Megatron-Bridge (`AutoBridge`).

`load(hf_path, cfg)` checks the folder before any weight is read (config present, architecture
supported, every config field reproduced exactly by this install - `models.support`, which refuses
with the field, value and reason -, TP divides the heads, safetensors rather than pickle, every
tensor the architecture needs present with its shape: `check_tensors`), builds the model from the HF
config with the local layer spec (Transformer Engine's where TE is installed), loads the HF
weights into the plain chunks, then wraps them (DDP or Megatron-FSDP). Loading before the
wrap means Megatron-FSDP copies the loaded values into both its compute and its fp32 main
weight shards, so the first forward already uses them (the Megatron-Bridge #3397 symptom -
a loaded checkpoint without effect until the first step - cannot happen). The cost: each rank
holds one full unsharded copy of its TP slice while loading.

Megatron's settings come from `transformer_settings.engine_settings`, as the GPT path's do: without Transformer
Engine, what the bridge's providers switch on but only TE has is switched off there (FUSIONS_OFF, MOE_TE_ONLY),
and so is the native fused cross-entropy (NATIVE_CE_FUSION_OFF); what an architecture's bridge lacks comes from
its spec (`models.archs`: weight mappings, an attention module of its own kept on the local spec), a vocabulary TP
does not divide is padded (`models.vocab`), and `load(..., verify=True)` compares the result with transformers'
logits (`models.verify`).

With `EngineConfig.lora`, `load` adds the adapters before the wrap (`engine.add_adapters`) and keeps the folder's
`base_reference` on the chunks (`keep_base`), so a checkpoint of the adapters names its base. A folder that does not
fit its own config.json raises `CheckpointError`, defined here, the lowest layer that reads saved weights, and
re-exported by `checkpoint` (imports point down).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import compat
from ..distributed import engine
from ..compat.access import bridge_model
from ..config import ConfigError, EngineConfig
from ..distributed.introspect import torch_dtype
from . import archs, support, transformer_settings, vocab


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, untrusted, does not fit the model, or could not be
    written; the message names the path and what to do. (An HF folder is a checkpoint too: `check_tensors`.)
    `checkpoint.CheckpointError` is this class."""


@dataclass
class HFModel:
    """A loaded model: its chunks and the bridge that maps names both ways."""

    chunks: list
    bridge: object
    hf_path: Path
    cfg: EngineConfig
    verification: object = None
    """`models.verify.Verification` when loaded with verify=True."""

    @property
    def config(self):
        return engine.unwrap_model(self.chunks[0]).config

    @property
    def vocab_size(self) -> int:
        """The HF vocabulary (Megatron's embedding may be padded beyond it; those ids are never real)."""
        return self.bridge.hf_pretrained.config.vocab_size


def supported_architectures() -> list[str]:
    compat.apply("bridge")
    from megatron.bridge import AutoBridge
    return sorted(AutoBridge.list_supported_models())


def check_folder(hf_path, cfg: EngineConfig | None = None, *, trust_pickle: bool = False, strict: bool = True) -> dict:
    """Validate an HF folder without reading weights; returns its config.json as a dict. `strict=False`:
    tensors the architecture lacks are listed in a warning instead of refused (`check_tensors`).

    Refuses (ConfigError naming the architecture or field, its value and why) every architecture
    and config field this install would not reproduce exactly: `models.support.check_config`."""
    path = Path(hf_path)
    if not path.is_dir():
        raise FileNotFoundError(f"hf_path={str(hf_path)!r}: no such directory")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"hf_path={str(hf_path)!r} has no config.json: not a Hugging Face model folder")
    config = json.loads(config_file.read_text())
    archs = config.get("architectures") or []
    supported = supported_architectures()
    if not any(a in supported for a in archs):
        raise ConfigError(f"architectures={archs} in {config_file} is not supported by Megatron-Bridge 0.3.1; "
                         f"supported: {', '.join(supported)}")
    try:
        support.check_config(config, cfg)
    except ConfigError as e:
        raise ConfigError(f"{config_file}: {e}") from None
    if cfg is not None:
        _check_heads(config, cfg.parallelism.tensor_model_parallel_size)
    if _check_weights(path, trust_pickle=trust_pickle):
        check_tensors(path, strict=strict)
    return config


def _check_heads(config: dict, tp: int) -> None:
    heads = config.get("num_attention_heads", 1)
    kv_heads = config.get("num_key_value_heads", heads)
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if value % tp:
            raise ConfigError(f"parallelism.tensor_model_parallel_size={tp} does not divide the model's "
                              f"{name}={value}; "
                             f"allowed: a divisor of {value}")


def _check_weights(path: Path, *, trust_pickle: bool) -> bool:
    """True when the weights are safetensors (whose headers `check_tensors` can read)."""
    if list(path.glob("*.safetensors")):
        return True
    pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    if pickles and not trust_pickle:
        raise ValueError(f"{path / pickles[0]} is a pickle checkpoint: loading it can run code. Convert it to "
                         "safetensors, or pass trust_pickle=True if you trust its source")
    if not pickles:
        raise FileNotFoundError(f"{path} holds no weights (*.safetensors)")
    return False


def expected_tensors(hf_path) -> dict[str, list[int]]:
    """Name -> shape of every parameter the folder's architecture needs (tied ones named once)."""
    return _architecture(hf_path)[0]


def _architecture(hf_path) -> tuple[dict[str, list[int]], set[str], list[str]]:
    """(`expected_tensors`, every name a folder of it may hold besides: tied copies, buffers such as old
    checkpoints' rotary inv_freq; the model class's own patterns of names transformers ignores on load).

    Built from config.json on the meta device: no memory, no init, seconds even for large models.
    """
    import transformers
    config = transformers.AutoConfig.from_pretrained(str(hf_path))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    known = set(model.state_dict()) | {name for name, _ in model.named_buffers()}
    return ({name: list(p.shape) for name, p in model.named_parameters()}, known,
            list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []))


def saved_tensors(hf_path) -> dict[str, tuple[list[int], str]]:
    """Name -> (shape, file name) of every tensor in the folder's *.safetensors (headers only)."""
    from safetensors import safe_open
    out = {}
    for file in sorted(Path(hf_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({name: (list(f.get_slice(name).get_shape()), file.name) for name in f.keys()})
    return out


def check_tensors(hf_path, *, strict: bool = True) -> None:
    """Refuse a folder whose safetensors lack or misshape a tensor the architecture needs, or hold one it
    does not know (`strict=False`: a warning lists those, and the load leaves them out).

    The naive load (Megatron-Bridge's `load_hf_weights`) logs one `WARNING: Can't find ...` for a
    missing tensor and leaves that Megatron parameter at its random init; training then runs on a
    half-loaded model; a tensor the architecture lacks (a layer config.json does not count) it skips
    without a word. Here the safetensors headers are compared with `expected_tensors` first, as a
    checkpoint load compares names and shapes (`checkpoint.integrity.check_fit`).
    """
    import re
    import warnings

    path = Path(hf_path)
    saved = saved_tensors(path)
    files = sorted({file for _, file in saved.values()})
    expected, known, ignored = _architecture(path)
    unexpected = [n for n in saved if n not in known and not any(re.search(r, n) for r in ignored)]
    if unexpected:
        listing = f"{len(unexpected)} tensor(s) in {path} that the architecture in config.json lacks: {unexpected[:5]}"
        if strict:
            raise CheckpointError(f"{listing}. The folder's config.json describes a smaller or other model than "
                                  "its weights; pass strict=False to load it without them")
        warnings.warn(f"{listing} are left out (strict=False)")
    missing = [n for n in expected if n not in saved]
    wrong = [f"{n} in {path / saved[n][1]}: saved {saved[n][0]}, the architecture needs {shape}"
             for n, shape in expected.items() if n in saved and saved[n][0] != shape]
    if missing:
        raise CheckpointError(f"{len(missing)} tensor(s) the architecture in {path / 'config.json'} needs are "
                              f"missing from {', '.join(str(path / f) for f in files)}: {missing[:5]}. The "
                              "folder is incomplete or its config.json belongs to another model")
    if wrong:
        raise CheckpointError(f"{len(wrong)} tensor(s) in {path} have the wrong shape: {'; '.join(wrong[:5])}. "
                              "The folder's config.json does not describe these weights (or they were saved transposed)")


def _layer_spec(cfg: EngineConfig, bridge_spec, hf_config: dict, spec: archs.ArchSpec | None):
    """The layer spec function: the bridge's own where TE is installed, else local (+ SDPA core
    attention if asked) with the architecture's own attention module where its bridge has one
    (`Bridge.local_attention` of its spec: OLMoE's QK norm over all heads)."""
    local_layer_spec, transformer_engine_layer_spec = bridge_model.layer_specs()
    from megatron.core.extensions.transformer_engine import HAVE_TE
    if HAVE_TE:
        return transformer_engine_layer_spec if bridge_spec is None else bridge_spec
    keeps = spec is not None and spec.bridge.local_attention
    attention = bridge_model.local_attention_module(bridge_spec) if keeps else None
    backend = support.attention_backend(cfg, hf_config)

    def layer_spec(config):
        s = local_layer_spec(config)
        if attention is not None:
            s.submodules.self_attention.module = attention
        if backend != "local":
            from .flex import core_attention
            s.submodules.self_attention.submodules.core_attention = core_attention(backend)
        return s
    return layer_spec


def fix_bridge(spec: archs.ArchSpec) -> None:
    """What the architecture's bridge lacks without TE (its spec's `Bridge.mappings`), added through compat."""
    compat.apply("bridge")
    if spec.bridge.mappings:
        compat.apply("bridge_mappings", architecture=spec.architecture, mappings=spec.bridge.mappings)


def provider(hf_path, cfg: EngineConfig, *, trust_remote_code: bool = False):
    """(bridge, megatron model provider) for an HF folder under `cfg` (not yet built)."""
    compat.apply("bridge")
    from megatron.bridge import AutoBridge
    from megatron.core.extensions.transformer_engine import HAVE_TE
    bridge = AutoBridge.from_hf_pretrained(str(hf_path), torch_dtype=torch_dtype(cfg.dtype),
                                           trust_remote_code=trust_remote_code)
    spec = archs.spec_for(bridge.hf_pretrained.config)
    if spec is not None:
        fix_bridge(spec)
    p = bridge.to_megatron_provider(load_weights=False)
    p.transformer_layer_spec = _layer_spec(cfg, getattr(p, "transformer_layer_spec", None),
                                           bridge.hf_pretrained.config.to_dict(), spec)
    settings = transformer_settings.engine_settings(
        cfg, te_spec=HAVE_TE, moe=bool(getattr(p, "num_moe_experts", None)),
        cpu_initialization=not torch.cuda.is_available())
    for key, value in settings.items():
        setattr(p, key, value)
    # after the overrides: which fusions apply depends on the model's final settings
    for key, value in transformer_settings.fused_kernel_settings(cfg, p, te_spec=HAVE_TE).items():
        setattr(p, key, value)
    vocab.configure(p, p.vocab_size, cfg.parallelism.tensor_model_parallel_size)
    p.window_size = support.megatron_window(bridge.hf_pretrained.config.to_dict(), getattr(p, "window_size", None))
    p.finalize()
    return bridge, p


def load_weights(bridge, chunks, hf_path, cfg: EngineConfig) -> None:
    """The HF folder's weights into the unwrapped `chunks`: the bridge's own load, or, where TP
    needs a padded vocabulary, the padded load with the padded logits masked."""
    hf_vocab = bridge.hf_pretrained.config.vocab_size
    padded = vocab.padded_size(hf_vocab, cfg.parallelism.tensor_model_parallel_size)
    if padded != hf_vocab:
        vocab.load_padded(bridge, chunks, padded)
        vocab.mask_padded_logits(chunks, hf_vocab)
    else:
        bridge.load_hf_weights(chunks, str(hf_path))


def _untimed(name: str, fn, *args, **kwargs):
    return fn(*args, **kwargs)


def load(hf_path, cfg: EngineConfig, *, wrap: bool = True, trust_pickle: bool = False,
         trust_remote_code: bool = False, verify: bool = False, phases=None, strict: bool = True) -> HFModel:
    """Megatron chunks with the HF folder's weights, wrapped (DDP | Megatron-FSDP) per `cfg`.

    A vocabulary TP does not divide is padded (models.vocab: zero rows, masked logits, trimmed
    exports). With `verify`, transformers' logits on the same folder are compared with the loaded
    model's on a few fixed sequences (models.verify) and a mismatch raises `VerificationError`;
    the result is `HFModel.verification`. `phases` (`perf.phases.Phases`) times each step under its
    name: check, provider, build, weights, lora (with `cfg.lora`: `lora.apply`'s work), wrap (what bench/load_hf.py
    and bench/notebook_setup.py print).
    `strict=False` loads a folder holding tensors its architecture lacks, listing them (`check_tensors`)."""
    run = phases.run if phases is not None else _untimed
    run("check", check_folder, hf_path, cfg, trust_pickle=trust_pickle, strict=strict)
    bridge, p = run("provider", provider, hf_path, cfg, trust_remote_code=trust_remote_code)
    chunks = run("build", engine.build, cfg, p, wrap=False)
    run("weights", load_weights, bridge, chunks, hf_path, cfg)
    if cfg.lora is not None:   # before the wrap: the wrappers lay out grad buffers from requires_grad
        run("lora", _add_adapters, chunks, lora=cfg.lora, base_path=hf_path)
    if wrap:
        chunks = run("wrap", engine.wrap_chunks, cfg, chunks)
    model = HFModel(chunks=chunks, bridge=bridge, hf_path=Path(hf_path), cfg=cfg)
    if verify:
        from .verify import verify as run_verify
        model.verification = run_verify(model, strict=True)
    return model


def _add_adapters(chunks, *, lora, base_path) -> None:
    """`lora.apply(chunks, lora=, base_path=)` at this layer: the adapters, then the base they belong to."""
    engine.add_adapters(chunks, lora=lora)
    keep_base(chunks, base_path=base_path)


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


def keep_base(chunks, *, base_path) -> None:
    """Keep the `base_reference` of the HF folder the frozen weights came from on each plain (LoRA-adapted) chunk,
    where `lora.base_of` finds it through the wrappers: checkpoints name their base and refuse another one."""
    reference = base_reference(base_path=base_path)
    for chunk in chunks:
        chunk.mfsdp_lora_base = reference
