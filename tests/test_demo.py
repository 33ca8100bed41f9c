"""`MODEL=<folder> make demo` with a tokenizer like Qwen3's and Llama 3's: no pad token, a chat
template that is not the tiny format; and a clear refusal when the tokenizer has no template."""
import json
import os
import subprocess
import sys

import pytest

from mfsdp_kit.train import chat, data
from mfsdp_kit import demo
from tests import chat_tokenizers as ct


def qwen3_folder(path, tok):
    """A Qwen3 model written by transformers (random weights) with `tok` beside it."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=None)
    Qwen3ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("make", [ct.qwen, ct.llama3])
def test_plan_fits_the_template(make):
    tok = make()
    plan = demo.plan(tok, dict(demo.CPU), heldout=10)
    prompt, reply = plan["pairs"][0]
    assert prompt == plan["task"].prompt(*plan["task"].problems(1)[0]) and reply.endswith(tok.convert_ids_to_tokens(
        chat.stop_ids(tok)[-1]))
    assert plan["seq_len_tokens"] == data.seq_len_needed(plan["pairs"], tok) > demo.CPU["seq_len_tokens"]
    batch = data.tokenize_sft(plan["pairs"], tok, seq_len_tokens=plan["seq_len_tokens"])   # no pad token: eos pads
    assert tok.pad_token_id is None and (batch.tokens[batch.loss_mask.sum(1).argmin(), -1] == tok.eos_token_id)
    assert plan["max_new_tokens"] == 2 + 1 + 1   # "18" + end-of-turn + one spare


def test_plan_for_the_tiny_model_is_todays_recipe():
    plan = demo.plan(data.tiny_tokenizer(), dict(demo.CPU), heldout=10)
    assert plan["seq_len_tokens"] == 16 and plan["max_new_tokens"] == demo.CPU["digits"] + 3
    assert plan["pairs"] == data.ArithmeticTask(digits=1).train_pairs(demo.CPU["train_pairs"])


def test_no_chat_template_is_refused_before_any_rank_starts(tmp_path):
    folder = qwen3_folder(tmp_path / "base", ct.qwen(template=None))
    with pytest.raises(chat.ChatTemplateError, match=rf"MODEL={folder}: the demo renders .* has no chat_template"):
        demo.tokenizer_for(str(folder))
    proc = subprocess.run([sys.executable, "-m", "mfsdp_kit.demo", "--out", str(tmp_path / "out")],
                          env={**os.environ, "MODEL": str(folder)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "has no chat_template" in proc.stderr and "torch.distributed.run" not in proc.stderr


@pytest.mark.slow
def test_demo_runs_on_a_qwen3_folder_without_pad_token(tmp_path):
    folder = qwen3_folder(tmp_path / "qwen3", ct.qwen())
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "mfsdp_kit.demo", "--out", str(out), "--steps", "4"],
                          env={**os.environ, "MODEL": str(folder)}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == str(folder) and len(summary["loss"]) == 4 and summary["recipe"]["seq_len_tokens"] > 16
    assert [p for p, _ in summary["samples"]] and all(p.endswith("=") for p, _ in summary["samples"])
    assert "rollout samples" in proc.stdout and summary["verification"]["ok"] is True
    assert summary["verification"]["relative"] < 1e-5 and "logits vs transformers" in proc.stdout


def test_stops_add_the_generation_config_eos_ids(tmp_path):
    from transformers import GenerationConfig
    tok = ct.qwen()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert demo.stops(tok, str(tmp_path)) == [tok.eos_token_id, im_end]   # no generation_config.json
    GenerationConfig(eos_token_id=[im_end, 7]).save_pretrained(tmp_path)   # as Llama 3.1 lists <|eom_id|>
    assert demo.stops(tok, str(tmp_path)) == [tok.eos_token_id, im_end, 7]
