"""models.archs: one registry of the HF model families, one file each, their names written nowhere else.

A spec is data that the loader (`models.support`, `models.hf`), compat and the rollout's decoder act on; these tests
hold each spec to the model transformers builds from its tiny config (on the meta device: no weights), and the kit
to naming architectures only in models/archs/. Model types ("qwen2") may name a family elsewhere (`models.tiny`,
`perf.hf_folder` pick one by it through `spec_for`)."""
import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
import torch
import transformers

from mfsdp_kit.config import ConfigError
from mfsdp_kit.models import archs, hf as hf_models, support
from mfsdp_kit.rl.rollout import decoder

KIT = Path(archs.__file__).resolve().parents[2]
FOLDER = Path(archs.__file__).resolve().parent


def test_each_family_file_holds_one_registered_spec():
    found = {}
    for module in pkgutil.iter_modules(archs.__path__):
        if module.name in archs.NOT_FAMILIES:
            continue
        family = importlib.import_module(f"{archs.__name__}.{module.name}")
        specs = [v for v in vars(family).values() if isinstance(v, archs.ArchSpec)]
        assert specs == [family.SPEC], f"{module.name}.py holds {len(specs)} ArchSpecs; one, named SPEC"
        found[family.SPEC.architecture] = family.SPEC
    assert found == archs.ARCHS and len(found) >= 6


def test_the_views_are_the_registry():
    assert archs.VERIFIED == tuple(sorted(archs.ARCHS))
    assert archs.SUPPORTED == tuple(a for a in archs.VERIFIED if archs.ARCHS[a].decoder is not None)
    assert not set(archs.ARCHS) & set(archs.REFUSED)
    assert set(archs.ARCHS) <= set(archs.ARCH_CONFIGS), "every family has a tiny config"
    assert archs.REFUSED == {r.architecture: r.reason for r in archs.refused.REFUSALS}
    assert (support.VERIFIED, support.REFUSED, decoder.SUPPORTED) == (archs.VERIFIED, archs.REFUSED, archs.SUPPORTED)


def test_every_family_runs_in_the_rollout_engine():
    """Each family's decoder hooks are tested against HF `generate` (tests/rl/rollout/test_engine.py runs SUPPORTED)."""
    assert archs.SUPPORTED == archs.VERIFIED


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="registered or refused already"):
        archs.register(archs.ARCHS["LlamaForCausalLM"])


@pytest.mark.parametrize("arch", archs.VERIFIED)
def test_a_spec_agrees_with_the_model_transformers_builds(arch):
    spec, config = archs.ARCHS[arch], archs.hf_config(arch)
    assert (type(config).__name__, config.model_type) == (spec.config_class, spec.model_type)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == arch
    assert all(archs.spec_for(x) is spec for x in (model, config, config.to_dict(), spec.model_type, arch))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q_norm = getattr(attn, "q_norm", None)
    qk_norm = None if q_norm is None else "head" if q_norm.weight.numel() == head_dim else "heads"
    assert spec.decoder.qk_norm == qk_norm, f"{arch}: its q_norm says {qk_norm!r}"
    assert spec.decoder.moe == (not hasattr(mlp, "gate_proj")), f"{arch}: its MLP says moe={spec.decoder.moe}"


@pytest.mark.parametrize("arch", [a for a in archs.REFUSED if a in archs.ARCH_CONFIGS])
def test_a_refused_tiny_config_is_written_and_refused_by_name(tmp_path, arch):
    archs.hf_config(arch).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=rf"architectures=\['{arch}'\].*refused here: ") as e:
        hf_models.check_folder(tmp_path)
    assert archs.REFUSED[arch] in str(e.value)


def test_spec_for_a_stranger_is_none():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    assert archs.spec_for(config) is archs.spec_for(GPT2LMHeadModel(config)) is archs.spec_for("gpt2") is None
    assert archs.spec_for({"architectures": ["GPT2LMHeadModel", "Qwen2ForCausalLM"]}) is archs.ARCHS["Qwen2ForCausalLM"]


def test_decoder_hooks_take_only_known_values():
    with pytest.raises(ConfigError, match=r"Decoder.qk_norm='per_head' is not allowed; allowed: None \| 'head'"):
        archs.Decoder(qk_norm="per_head")


def named_architectures(path: Path, names: set[str]) -> list[str]:
    """Where `path` names an architecture: a string literal (not a docstring: prose may mention a family) holding
    one, or an identifier (an import, a name, an attribute) that is one."""
    tree, found = ast.parse(path.read_text()), []
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(names))) + r")\b")
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            found += [f"line {node.lineno}: {m!r}" for m in pattern.findall(node.value)]
        idents = ([a.name.rpartition(".")[2] for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom))
                  else [node.id] if isinstance(node, ast.Name) else [node.attr] if isinstance(node, ast.Attribute)
                  else [])
        found += [f"line {node.lineno}: {ident}" for ident in idents if ident in names]
    return found


def test_architectures_are_named_only_in_models_archs():
    names = set(archs.ARCHS) | set(archs.REFUSED)
    outside = {str(p.relative_to(KIT)): v for p in KIT.rglob("*.py") if FOLDER not in p.parents
               and (v := named_architectures(p, names))}
    assert not outside, f"architecture names outside mfsdp_kit/models/archs/ (ask models.archs instead): {outside}"
    inside = [v for p in FOLDER.glob("*.py") for v in named_architectures(p, names)]
    assert len(inside) >= len(names), "the scan finds the names not even where they are listed"
