"""A vocabulary TP does not divide (1003 at TP 2) is padded as Megatron pads it, and the padding never
leaks: logits == HF, the loss == HF's cross-entropy over the real vocabulary, export exact with HF
shapes before and after a step. FSDP and DDP, 2 gloo ranks, a Qwen2 written by transformers."""
import pytest

from mfsdp_kit.models import vocab
from tests.dist import launch


def test_padded_size_is_megatrons_rule():
    assert vocab.padded_size(1003, 2) == 1024       # 128 * 2 = 256 -> 4 * 256
    assert vocab.padded_size(517, 2) == 768
    assert vocab.padded_size(1003, 1) == 1003       # TP divides it: no padding, HF shapes inside too
    assert vocab.padded_size(151936, 2) == 151936


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("vocab")
    (work / "tied").mkdir()
    calls = [["scenarios_arch:arch_roundtrip", dict(arch="Qwen2ForCausalLM", tp=2, fsdp=fsdp, vocab_size=1003,
                                                     workdir=str(work))] for fsdp in (True, False)]
    calls.append(["scenarios_arch:arch_roundtrip", dict(arch="Qwen2ForCausalLM", tp=2, fsdp=True, vocab_size=1003,
                                                        workdir=str(work / "tied"),   # a folder of its own
                                                        overrides=dict(tie_word_embeddings=True))])
    return dict(zip((True, False, "tied"), launch.run("sequence", calls=calls)))


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp", "ddp"])
def test_odd_vocabulary_at_tp2(runs, fsdp):
    r = runs[fsdp]
    print("fsdp" if fsdp else "ddp", r["verify"], "loss", r["megatron_loss"], "HF", r["hf_loss"])
    assert r["megatron_vocab"] == 1024
    assert r["verify"]["ok"] and r["verify"]["relative"] < 1e-5
    assert abs(r["megatron_loss"] - r["hf_loss"]) < 1e-5  # the 21 padded ids take no probability
    assert r["export_names_match"] and r["export_shapes_match"] and r["export_maxdiff"] == 0.0
    assert r["changed_by_step"] > 0 and r["trained_shapes_match"]
    assert r["reload_relative"] < 1e-5  # save_hf wrote HF shapes; transformers reloads it


def test_fsdp_and_ddp_agree(runs):
    assert abs(runs[True]["loss"] - runs[False]["loss"]) < 1e-6


def test_tied_embeddings_with_an_odd_vocabulary(runs):
    """Qwen2.5-0.5B / Llama-3.2-1B style: one matrix is the embedding and the output layer; padded
    rows are zero for both uses, padded logits masked, export has the HF shape (no lm_head.weight)."""
    r = runs["tied"]
    print(r["verify"], "loss", r["megatron_loss"], "HF", r["hf_loss"], "reload", r["reload_relative"])
    assert r["megatron_vocab"] == 1024 and r["verify"]["relative"] < 1e-5
    assert abs(r["megatron_loss"] - r["hf_loss"]) < 1e-5
    assert r["export_names_match"] and r["export_shapes_match"] and r["export_maxdiff"] == 0.0
    assert r["trained_shapes_match"] and r["reload_relative"] < 1e-5
