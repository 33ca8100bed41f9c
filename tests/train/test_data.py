"""Embedded data: arithmetic task, SFT tokenization and masks, the JSONL loader."""
import json

import pytest
import torch

from mfsdp_kit.train.data import (ArithmeticTask, batches, digit_match, is_heldout, load_jsonl, render_chat,
                                  seq_len_needed, tokenize_sft, verify)
from mfsdp_kit.models.tiny import build_tokenizer
from mfsdp_kit.train import Batch


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_pair_format():
    task = ArithmeticTask(digits=2, ops=("+",))
    assert task.prompt(12, "+", 34) == "<|user|>12+34=<|assistant|>"
    prompt, response = task.train_pairs(1)[0]
    assert prompt.startswith("<|user|>") and response.endswith("</s>")
    assert verify(prompt, response) == 1.0


def test_deterministic_by_seed():
    a, b = ArithmeticTask(ops=("+", "-", "*"), seed=3), ArithmeticTask(ops=("+", "-", "*"), seed=3)
    assert a.train_pairs(50) == b.train_pairs(50) and a.heldout_pairs(20) == b.heldout_pairs(20)
    assert a.train_pairs(20) == a.train_pairs(50)[:20]  # a longer n extends a shorter one
    assert ArithmeticTask(ops=("+", "-", "*"), seed=4).train_pairs(50) != a.train_pairs(50)


@pytest.mark.parametrize("digits", [1, 2, 4])  # 4 digits: the sampled (not enumerated) path
def test_heldout_disjoint_from_train(digits):
    task = ArithmeticTask(digits=digits, ops=("+", "*"))
    n_train = 80 if digits == 1 else 2000
    train, heldout = task.problems(n_train), task.problems(15, split="heldout")
    assert len(set(train)) == n_train and not set(train) & set(heldout)
    assert not any(is_heldout(*p) for p in train) and all(is_heldout(*p) for p in heldout)
    assert not {p for p, _ in task.train_pairs(n_train)} & {p for p, _ in task.heldout_pairs(15)}


def test_too_many_problems_and_bad_args():
    with pytest.raises(ValueError, match="n=1000"):
        ArithmeticTask(digits=1).train_pairs(1000)
    with pytest.raises(ValueError, match="ops="):
        ArithmeticTask(ops=("/",))
    with pytest.raises(ValueError, match="split="):
        ArithmeticTask().rl_prompts(3, split="test")


def test_rl_prompts_and_verify():
    task = ArithmeticTask(digits=2, ops=("-",), seed=1)
    for prompt, answer in task.rl_prompts(20, split="heldout"):
        assert verify(prompt, answer) == 1.0 and task.verify(prompt, answer + "</s>") == 1.0
    p = "<|user|>12-34=<|assistant|>"
    assert verify(p, "-22") == verify(p, "-22</s>") == verify(p, "-22</s>9999 junk") == 1.0
    assert verify(p, "-22 because") == verify(p, " -22\n") == 1.0
    assert verify(p, "22") == verify(p, "-221") == verify(p, "") == verify(p, "</s>-22") == 0.0
    assert verify(p, "-022") == verify(p, "x-22") == verify(p, "-2 2") == 0.0
    assert verify("<|user|>7*8=<|assistant|>", "56</s><pad><pad>") == 1.0
    with pytest.raises(ValueError, match="not an arithmetic prompt"):
        verify("hello", "1")


def test_digit_match_by_hand():
    p = "<|user|>27+19=<|assistant|>"  # 46
    assert digit_match(p, "46</s>") == digit_match(p, " 46 junk") == 1.0
    assert digit_match(p, "45") == 0.5  # tens right, units wrong
    assert digit_match(p, "56") == 0.5
    assert digit_match(p, "64") == 0.0  # digits right, places wrong
    assert digit_match(p, "146") == pytest.approx(2 / 3)  # right-aligned: 4 and 6 match, 3 long
    assert digit_match(p, "6") == 0.5
    assert digit_match(p, "") == digit_match(p, "x46") == digit_match(p, "</s>46") == 0.0
    q = "<|user|>999+1=<|assistant|>"  # 1000
    assert digit_match(q, "100") == 0.5  # "0","0" match "1000"'s last two; "1" vs "0" no; over 4
    assert digit_match(q, "1001</s>") == 0.75
    r = "<|user|>3-5=<|assistant|>"  # -2
    assert digit_match(r, "2") == 0.5 and digit_match(r, "-2") == 1.0
    for prompt, answer in ArithmeticTask(digits=3, seed=2).rl_prompts(20):
        assert digit_match(prompt, answer) == 1.0  # exact -> 1.0, the same cases verify accepts
    with pytest.raises(ValueError, match="not an arithmetic prompt"):
        digit_match("hello", "1")


def test_loss_mask_covers_exactly_the_answer(tok):
    pairs = ArithmeticTask(digits=3, ops=("+", "-", "*"), seed=2).train_pairs(16)
    batch = tokenize_sft(pairs, tok, seq_len_tokens=32)
    assert isinstance(batch, Batch) and batch.tokens.shape == batch.labels.shape == (16, 32)
    assert batch.tokens.dtype == torch.long and batch.loss_mask.dtype == torch.float32
    for i, (prompt, response) in enumerate(pairs):
        masked = batch.labels[i][batch.loss_mask[i] == 1].tolist()
        assert tok.decode(masked) == response  # answer digits + eos, nothing else
        n = len(tok(prompt + response)["input_ids"]) - 1  # positions in use
        assert torch.equal(batch.labels[i, :n - 1], batch.tokens[i, 1:n])  # shifted by one
        assert (batch.tokens[i, n:] == tok.pad_token_id).all() and batch.loss_mask[i, n:].sum() == 0
        assert tok.decode(batch.tokens[i, :n].tolist()) + "</s>" == prompt + response


def test_truncation_that_cuts_answer_raises(tok):
    pairs = [("<|user|>12+34=<|assistant|>", "46</s>")]  # 8 + 3 tokens -> 10 positions
    assert tokenize_sft(pairs, tok, seq_len_tokens=10).loss_mask.sum() == 3
    with pytest.raises(ValueError, match="seq_len_tokens=9"):
        tokenize_sft(pairs, tok, seq_len_tokens=9)


def test_one_length_for_every_tokenizer(tok):
    """The notebooks' 16 tokens for the tiny model; a chat template with a system turn gets the next multiple of 16
    that keeps every example whole, so its batches tokenize instead of raising."""
    from tests import chat_tokenizers
    assert seq_len_needed(ArithmeticTask(digits=1).train_pairs(90), tok, multiple_of=16) == 16
    qwen = chat_tokenizers.qwen()
    pairs = ArithmeticTask(digits=1, tokenizer=qwen).train_pairs(90)
    need, length = seq_len_needed(pairs, qwen), seq_len_needed(pairs, qwen, multiple_of=16)
    assert need > 16 and length % 16 == 0 and need <= length < need + 16
    assert tokenize_sft(pairs, qwen, seq_len_tokens=length).loss_mask.sum(dim=1).min() > 0
    for bad in (0, -16, 2.0):
        with pytest.raises(ValueError, match=rf"^multiple_of={bad!r} .*an integer >= 1"):
            seq_len_needed(pairs, qwen, multiple_of=bad)


def test_batches_deterministic_and_cycling(tok):
    pairs = ArithmeticTask(seed=5).train_pairs(10)
    make = lambda seed: list(batches(pairs, tok, seq_len_tokens=16, global_batch=4, seed=seed, num_batches=5))
    a, b, c = make(0), make(0), make(1)
    assert len(a) == 5 and all(x.tokens.shape == (4, 16) for x in a)
    assert all(torch.equal(x.tokens, y.tokens) and torch.equal(x.loss_mask, y.loss_mask) for x, y in zip(a, b))
    assert not all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, c))
    seen = torch.cat([x.tokens for x in a[:5]])[:20]  # 20 sequences = two full epochs
    full = tokenize_sft(pairs, tok, seq_len_tokens=16).tokens
    for epoch in (seen[:10], seen[10:]):  # each epoch is a permutation of the data
        assert sorted(map(tuple, epoch.tolist())) == sorted(map(tuple, full.tolist()))


def _write(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_prompt_response_and_messages(tmp_path, tok):
    rows = [json.dumps({"prompt": "1+1=", "response": "2"}), "",
            json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi"},
                                     {"role": "assistant", "content": "Hello."},
                                     {"role": "user", "content": "2+2="},
                                     {"role": "assistant", "content": "4"}]})]
    examples = load_jsonl(_write(tmp_path, rows), tok)
    assert tok.decode(examples[0].ids) == "<|user|>1+1=<|assistant|>2</s>"
    assert tok.decode(examples[1].ids) == "Be brief.\n<|user|>Hi<|assistant|>Hello.</s><|user|>2+2=<|assistant|>4</s>"
    messages = json.loads(rows[2])["messages"]
    assert tok.apply_chat_template(messages, tokenize=False) == render_chat(messages, add_generation_prompt=False)
    batch = tokenize_sft(examples, tok, seq_len_tokens=64)
    assert tok.decode(batch.labels[0][batch.loss_mask[0] == 1].tolist()) == "2</s>"
    assert tok.decode(batch.labels[1][batch.loss_mask[1] == 1].tolist()) == "Hello.</s>4</s>"   # every assistant turn
    pair = tokenize_sft([("<|user|>1+1=<|assistant|>", "2</s>")], tok, seq_len_tokens=64)
    assert torch.equal(pair.loss_mask[0], batch.loss_mask[0]) and torch.equal(pair.tokens[0], batch.tokens[0])


def test_jsonl_malformed_row_names_line(tmp_path, tok):
    path = _write(tmp_path, [json.dumps({"prompt": "a", "response": "b"}), '{"prompt": "a", '])
    with pytest.raises(ValueError, match=r"data.jsonl:2: malformed JSON"):
        load_jsonl(path, tok)


def test_jsonl_missing_key(tmp_path, tok):
    path = _write(tmp_path, [json.dumps({"prompt": "a", "response": "b"}), "",
                             json.dumps({"prompt": "a", "answer": "b"})])
    with pytest.raises(ValueError, match=r"data.jsonl:3: missing 'prompt'\+'response'.*accepted shapes") as e:
        load_jsonl(path, tok)
    assert "['answer', 'prompt']" in str(e.value)
    bad_role = _write(tmp_path, [json.dumps({"messages": [{"role": "bot", "content": "x"}]})])
    with pytest.raises(ValueError, match=r":1: messages\[0\] needs 'role'"):
        load_jsonl(bad_role, tok)
    no_answer = _write(tmp_path, [json.dumps({"messages": [{"role": "user", "content": "x"}]})])
    with pytest.raises(ValueError, match="last message must be the assistant"):
        load_jsonl(no_answer, tok)


def test_jsonl_empty(tmp_path, tok):
    for text in ("", "\n  \n"):
        path = tmp_path / "empty.jsonl"
        path.write_text(text)
        with pytest.raises(ValueError, match="empty"):
            load_jsonl(path, tok)
