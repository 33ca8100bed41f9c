"""Tiny HF models: load with Auto* classes, run forward, same seed -> same bytes."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mfsdp_kit.train.chat import end_of_turn_id, stop_ids
from mfsdp_kit.models import SIZES, tiny
from mfsdp_kit.models.tiny import SPECIAL_TOKENS, VOCAB_MULTIPLE, cached, param_count


@pytest.fixture(scope="module")
def xs_path(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("xs"), arch="qwen2", size="xs", seed=0)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("size", ["xs", "s"])
def test_loads_and_runs(tmp_path, arch, size):
    path = tiny(tmp_path, arch=arch, size=size, seed=1)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched keys
    assert model.config.model_type == arch and model.dtype == torch.float32
    assert not model.config.tie_word_embeddings and model.config.max_position_embeddings == 256
    assert model.config.vocab_size % VOCAB_MULTIPLE == 0
    assert model.num_parameters() == param_count(size, arch=arch)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == model.config.vocab_size
    ids = torch.tensor([tok("<|user|>12+34=<|assistant|>")["input_ids"]])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and torch.isfinite(logits).all()


def test_same_seed_same_bytes(tmp_path, xs_path):
    again = tiny(tmp_path / "a", size="xs", seed=0)
    other = tiny(tmp_path / "b", size="xs", seed=1)
    weights = (xs_path / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == weights
    assert (other / "model.safetensors").read_bytes() != weights


def test_init_values(xs_path):
    model = AutoModelForCausalLM.from_pretrained(xs_path)
    sd = model.state_dict()
    assert torch.equal(sd["model.norm.weight"], torch.ones_like(sd["model.norm.weight"]))
    emb = sd["model.embed_tokens.weight"]
    assert abs(emb.std().item() - 0.02) < 0.003 and not torch.equal(emb, sd["lm_head.weight"])


@pytest.mark.parametrize("size", ["m", "mw"])
def test_gpu_sizes_param_count(size):
    n = param_count(size)
    assert 100e6 <= n <= 300e6, n
    heads = SIZES[size]
    assert heads["num_attention_heads"] % 2 == 0 and heads["num_key_value_heads"] % 2 == 0


@pytest.mark.parametrize("size", ["m", "mw"])
def test_gpu_sizes_write_and_load(tmp_path, size):
    path = tiny(tmp_path, size=size, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.num_parameters() == param_count(size)


@pytest.mark.parametrize("field, kwargs", [("arch", dict(arch="gpt2")), ("size", dict(size="xl"))])
def test_bad_args_name_the_field(tmp_path, field, kwargs):
    with pytest.raises(ValueError, match=rf"{field}=.* allowed") as e:
        tiny(tmp_path, **kwargs)
    assert repr(next(iter(kwargs.values()))) in str(e.value)
    assert not (tmp_path / "config.json").exists()
    with pytest.raises(ValueError, match=rf"{field}=.* allowed"):
        cached(root=tmp_path / "cache", **kwargs)
    assert not (tmp_path / "cache").exists()


def test_positions_reach_the_config_and_leave_the_weights(tmp_path, xs_path):
    """`positions` is the written config's max_position_embeddings; the weights are the default folder's; a bad
    value is refused by name before anything is written."""
    from safetensors.torch import load_file
    path = tiny(tmp_path / "long", positions=1024)
    assert AutoModelForCausalLM.from_pretrained(path).config.max_position_embeddings == 1024
    a, b = load_file(path / "model.safetensors"), load_file(xs_path / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match=r"positions=0 .*allowed.*positive integer"):
        tiny(tmp_path / "bad", positions=0)
    assert not (tmp_path / "bad").exists()


def test_cached_names_the_knob_when_it_cannot_write(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="MFSDP_KIT_CACHE"):
        cached(size="xs", root=blocker / "cache")


def test_cached_is_written_once_whole_and_equal(tmp_path, xs_path):
    path = cached(size="xs", seed=0, root=tmp_path)
    assert path.parent == tmp_path and path.name.startswith("tiny-qwen2-xs-seed0-")
    assert (path / "model.safetensors").read_bytes() == (xs_path / "model.safetensors").read_bytes()
    assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in xs_path.iterdir())
    written = (path / "model.safetensors").stat().st_mtime_ns
    assert cached(size="xs", seed=0, root=tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == written        # reused
    other = cached(size="xs", seed=1, root=tmp_path)
    assert other != path and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no leftovers


def test_tokenizer(xs_path):
    tok = AutoTokenizer.from_pretrained(xs_path)
    ids = tok("12+34=")["input_ids"]
    assert len(ids) == 6 and tok.decode(ids) == "12+34="
    text = "What is (3*4)-5? It's 7!\nOk: yes, done."
    assert tok.decode(tok(text)["input_ids"]) == text and len(tok(text)["input_ids"]) == len(text)
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id] == [0, 1, 2, 3]
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS[4:])) == [4, 5]
    assert tok("<|user|>1+1=<|assistant|>2</s>")["input_ids"] == [4, 7, 16, 7, 19, 5, 8, 2]
    chat = tok.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|user|>1+1=<|assistant|>"
    assert stop_ids(tok) == [2] and end_of_turn_id(tok) == 2   # the saved template ends a turn with eos
    assert tok("é")["input_ids"] == [tok.unk_token_id]
