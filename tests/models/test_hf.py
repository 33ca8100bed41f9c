"""HF <-> Megatron through Megatron-Bridge: logits parity, exact export, FSDP == DDP, bad inputs."""
import json

import pytest
import torch
from safetensors.torch import load_file

from mfsdp_kit.config import EngineConfig
from mfsdp_kit.models import hf as hf_models
from mfsdp_kit.models.tiny import tiny
from tests.dist import launch

CASES = [("qwen2", 1, True), ("qwen2", 1, False), ("llama", 2, True), ("llama", 1, False), ("qwen2", 2, False)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("hf")
    calls = [["hf_roundtrip", dict(arch=c[0], tp=c[1], fsdp=c[2], workdir=str(work))] for c in CASES]
    return dict(zip(CASES, launch.run("sequence", nproc=2, calls=calls, timeout_s=1200)))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-tp{c[1]}-{'fsdp' if c[2] else 'ddp'}")
def test_logits_match_hf(runs, case):
    r = runs[case]
    print(case, "logits max|diff|", r["logits_maxdiff"], "export max|diff|", r["export_maxdiff"])
    assert r["wrapper"] == ("FullyShardedDataParallel" if case[2] else "DistributedDataParallel")
    assert r["logits_maxdiff"] < 1e-5


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-tp{c[1]}-{'fsdp' if c[2] else 'ddp'}")
def test_export_is_exact_and_reloads(runs, case):
    r = runs[case]
    assert r["export_names_match"] and r["export_maxdiff"] == 0.0
    assert r["changed_by_step"] > 0  # the step moved the weights the export shows
    assert r["reload_vs_megatron_maxdiff"] < 1e-5


def test_fsdp_export_equals_ddp_export_after_a_step(runs):
    fsdp = load_file(runs[("qwen2", 1, True)]["exported_file"])
    ddp = load_file(runs[("qwen2", 1, False)]["exported_file"])
    assert sorted(fsdp) == sorted(ddp)
    worst = max((fsdp[k] - ddp[k]).abs().max().item() for k in fsdp)
    print("FSDP vs DDP export after one step: max|diff|", worst)
    assert worst < 1e-6


# ---- bad inputs: a clear error before any weight is read -----------------------------------
def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        hf_models.check_folder(tmp_path / "nope")


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf_models.check_folder(tmp_path)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: .*LlamaForCausalLM") as e:
        hf_models.check_folder(tmp_path)
    assert "Qwen2ForCausalLM" in str(e.value)


def test_tp_must_divide_heads(tmp_path):
    path = tiny(tmp_path / "m", size="xs")  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4 does not divide the model's num_key_value_heads=2"):
        hf_models.check_folder(path, EngineConfig(tensor_model_parallel_size=4))


def test_pickle_weights_refused_unless_trusted(tmp_path):
    path = tiny(tmp_path / "m", size="xs")
    weights = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    torch.save(weights, path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model.bin is a pickle checkpoint.*trust_pickle=True"):
        hf_models.check_folder(path)
    hf_models.check_folder(path, trust_pickle=True)


def test_trust_remote_code_off_by_default():
    import inspect
    for fn in (hf_models.load, hf_models.provider):
        assert inspect.signature(fn).parameters["trust_remote_code"].default is False
