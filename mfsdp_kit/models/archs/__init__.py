"""The architectures the kit knows: one module per HF model family, each holding one `SPEC` (`spec.ArchSpec`), and
the architectures it refuses by name (`refused.py`). This package is the only place that names them.

    ARCHS                       architecture -> ArchSpec, every family module's SPEC
    spec_for(model | config)    the spec of an HF model, config or config.json dict (None: not a registered family)
    register(spec)              one more family at run time (each family module here is registered on import)
    VERIFIED, REFUSED, SUPPORTED, ARCH_CONFIGS    views of the registry the loader, the rollout and the tests read

Tiny models of any of them, written by `transformers` itself (the kit never saw them): `models.tiny` writes the kit's
own model (its own tensor values); a researcher arrives with a folder the kit did not make, and
`write_tiny(arch, path)` makes one the way theirs would have been made - `AutoModelForCausalLM.from_config(config)
.save_pretrained(path)` with transformers' own random init - plus a word-level tokenizer built with `tokenizers`
(no download, no pad token: like Llama 3's). Two layers, hidden 64, 4 heads / 2 KV heads (`spec.BASE`): seconds on
CPU.
"""
from __future__ import annotations

import importlib
import pathlib
import pkgutil

import torch

from ...fieldtypes import bad_value
from .refused import REFUSALS
from .spec import BASE, MOE, ArchSpec, Bridge, Decoder, Refused, refuse

NOT_FAMILIES = ("spec", "refused")
"""The modules of this package that are no family (every other one holds a `SPEC`)."""

ARCHS: dict[str, ArchSpec] = {}
"""Architecture (HF class name) -> its spec, for every family this install reproduces exactly."""


def register(spec: ArchSpec) -> ArchSpec:
    """Add `spec` to ARCHS and the views here; a name registered or refused already raises ValueError. (A name
    imported from here before, `from mfsdp_kit.models.archs import VERIFIED`, keeps the tuple it got.)"""
    if spec.architecture in ARCHS or spec.architecture in REFUSED:
        raise ValueError(f"architecture={spec.architecture!r} is registered or refused already")
    specs = sorted([*ARCHS.values(), spec], key=lambda s: s.architecture)   # the views list them in order
    ARCHS.clear()
    ARCHS.update((s.architecture, s) for s in specs)
    _refresh_views()
    return spec


def spec_for(obj) -> ArchSpec | None:
    """The spec of an HF model (by its class), an HF config or a config.json dict (the first of its `architectures`
    registered), or a model_type string; None when it is not a registered family."""
    if isinstance(obj, str):
        return ARCHS.get(obj) or next((s for s in ARCHS.values() if s.model_type == obj), None)
    if isinstance(obj, torch.nn.Module):
        return ARCHS.get(type(obj).__name__)
    names = obj.get("architectures") if isinstance(obj, dict) else getattr(obj, "architectures", None)
    return next((ARCHS[n] for n in names or [] if n in ARCHS), None)


REFUSED: dict[str, str] = {r.architecture: r.reason for r in REFUSALS}
"""Architecture -> why this install refuses it (what it would need)."""
VERIFIED: tuple[str, ...] = ()
"""Architectures whose tiny transformers-made models match HF logits through load -> wrap -> export
(tests/models/test_arch_table.py). Real checkpoints of these families also pass the field rules (`models.support`)."""
SUPPORTED: tuple[str, ...] = ()
"""Architectures whose decoder layer the rollout engine reproduces (those whose spec has `decoder` hooks)."""
ARCH_CONFIGS: dict[str, tuple[str, dict]] = {}
"""Architecture -> (transformers config class, its tiny config's fields over BASE), registered and refused alike:
those `write_tiny` can write."""


def _refresh_views() -> None:
    global VERIFIED, SUPPORTED
    VERIFIED = tuple(ARCHS)
    SUPPORTED = tuple(a for a, s in ARCHS.items() if s.decoder is not None)
    ARCH_CONFIGS.clear()
    ARCH_CONFIGS.update({s.architecture: (s.config_class, s.tiny) for s in (*ARCHS.values(), *REFUSALS)
                         if s.config_class is not None})


def _register_families() -> None:
    for module in pkgutil.iter_modules(__path__):
        if module.name not in NOT_FAMILIES:
            register(importlib.import_module(f"{__name__}.{module.name}").SPEC)


_register_families()

SPECIAL = ("<unk>", "<s>", "</s>")
"""Tokenizer ids 0..2; the remaining ids are words w3, w4, ... No pad token."""


def hf_config(arch: str, *, vocab_size: int = 256, **overrides):
    """The transformers config of a tiny `arch` model (fp32, untied embeddings)."""
    import transformers
    if arch not in ARCH_CONFIGS:
        raise bad_value("arch", arch, ", ".join(ARCH_CONFIGS))
    cls_name, extra = ARCH_CONFIGS[arch]
    config = getattr(transformers, cls_name)(**{**BASE, **extra, "vocab_size": vocab_size, **overrides})
    config.architectures = [arch]
    config.torch_dtype = torch.float32
    return config


def build_tokenizer(vocab_size: int):
    """A word-level `PreTrainedTokenizerFast` over `vocab_size` ids (whitespace split, no pad token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = list(SPECIAL) + [f"w{i}" for i in range(len(SPECIAL), vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def write_tiny(arch: str, path, *, vocab_size: int = 256, seed: int = 0, **overrides) -> pathlib.Path:
    """Write an HF folder for a tiny `arch` model with transformers' own random init (seeded)."""
    import transformers
    config = hf_config(arch, vocab_size=vocab_size, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = pathlib.Path(path)
    model.save_pretrained(path)
    build_tokenizer(vocab_size).save_pretrained(path)
    return path


__all__ = ["ARCHS", "ARCH_CONFIGS", "BASE", "MOE", "REFUSED", "SUPPORTED", "VERIFIED", "ArchSpec", "Bridge",
           "Decoder", "Refused", "build_tokenizer", "hf_config", "refuse", "register", "spec_for", "write_tiny"]
