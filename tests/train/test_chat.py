"""Chat templates: rendered text and loss masks token by token, for ChatML (Qwen) and Llama 3
templates on tokenizers built with `tokenizers`, the tiny model's own template, and the errors."""
import json

import pytest
import torch

from mfsdp_kit.train import chat, data
from tests import chat_tokenizers as ct

CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "Four."}]


def marked(tok, ids, target) -> list[str]:
    """Token strings, the trained ones starred: ['<|im_start|>', ..., '*Hello', '*.', '*<|im_end|>']."""
    return [("*" if t else "") + s for s, t in zip(tok.convert_ids_to_tokens(list(ids)), target)]


@pytest.fixture(scope="module")
def qwen():
    return ct.qwen()


@pytest.fixture(scope="module")
def llama3():
    return ct.llama3()


def test_chatml_multi_turn_text_and_mask(qwen):
    assert chat.render(qwen, CONVERSATION) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\nFour.<|im_end|>\n")
    ids, target = chat.encode(qwen, CONVERSATION)
    assert marked(qwen, ids, target) == [
        "<|im_start|>", "system", "\n", "Be", " ", "brief", ".", "<|im_end|>", "\n",
        "<|im_start|>", "user", "\n", "Hi", "<|im_end|>", "\n",
        "<|im_start|>", "assistant", "\n", "*Hello", "*.", "*<|im_end|>", "\n",   # the template's "\n" is not trained
        "<|im_start|>", "user", "\n", "What", " ", "is", " ", "2", "+", "2", "?", "<|im_end|>", "\n",
        "<|im_start|>", "assistant", "\n", "*Four", "*.", "*<|im_end|>", "\n"]


def test_chatml_default_system_turn(qwen):
    """Qwen's template writes a system turn when the conversation has none: part of every prefix."""
    ids, target = chat.encode(qwen, CONVERSATION[1:3])
    assert marked(qwen, ids, target) == [
        "<|im_start|>", "system", "\n", "You", " ", "are", " ", "a", " ", "helpful", " ", "assistant", ".",
        "<|im_end|>", "\n", "<|im_start|>", "user", "\n", "Hi", "<|im_end|>", "\n",
        "<|im_start|>", "assistant", "\n", "*Hello", "*.", "*<|im_end|>", "\n"]


def test_llama3_multi_turn_text_and_mask(llama3):
    assert chat.render(llama3, CONVERSATION) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nFour.<|eot_id|>")
    ids, target = chat.encode(llama3, CONVERSATION)
    head = lambda role: ["<|start_header_id|>", role, "<|end_header_id|>", "\n", "\n"]
    assert marked(llama3, ids, target) == (
        ["<|begin_of_text|>"] + head("system") + ["Be", " ", "brief", ".", "<|eot_id|>"]
        + head("user") + ["Hi", "<|eot_id|>"]
        + head("assistant") + ["*Hello", "*.", "*<|eot_id|>"]
        + head("user") + ["What", " ", "is", " ", "2", "+", "2", "?", "<|eot_id|>"]
        + head("assistant") + ["*Four", "*.", "*<|eot_id|>"])


def test_qwen3_think_block_only_in_the_last_reply():
    """Qwen3 writes an empty <think></think> into the reply after the last question only: rendered
    as if it were last, an earlier reply would differ, so the reply is located in the whole text."""
    tok = ct.qwen3()
    ids, target = chat.encode(tok, CONVERSATION[1:])
    assert chat.render(tok, CONVERSATION[1:]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nFour.<|im_end|>\n")
    assert marked(tok, ids, target) == [
        "<|im_start|>", "user", "\n", "Hi", "<|im_end|>", "\n",
        "<|im_start|>", "assistant", "\n", "*Hello", "*.", "*<|im_end|>", "\n",
        "<|im_start|>", "user", "\n", "What", " ", "is", " ", "2", "+", "2", "?", "<|im_end|>", "\n",
        "<|im_start|>", "assistant", "\n", "*<think>", "*\n", "*\n", "*</think>", "*\n", "*\n",
        "*Four", "*.", "*<|im_end|>", "\n"]
    assert chat.stop_ids(tok) == [tok.convert_tokens_to_ids("<|im_end|>")]   # eos is the end-of-turn
    task = data.ArithmeticTask(tokenizer=tok)
    assert task.reply("46") == "<think>\n\n</think>\n\n46<|im_end|>"
    assert all(data.verify(p, r) == 1.0 for p, r in task.train_pairs(5))


def test_template_without_end_of_turn_token():
    tok = ct.qwen(ct.PLAIN_TEMPLATE)
    ids, target = chat.encode(tok, CONVERSATION[1:])
    assert chat.end_of_turn_id(tok) is None and chat.stop_ids(tok) == [tok.eos_token_id]
    assert tok.decode([i for i, t in zip(ids, target) if t]) == "Hello.\nFour.\n"   # through the turn's end


def test_generation_tags_give_the_same_mask():
    """A template with {% generation %} markers: its own mask, equal to the prefix-rendering one."""
    tagged, plain = ct.qwen(ct.CHATML_TAGGED), ct.qwen(ct.CHATML_NO_SYSTEM)
    assert chat.render(tagged, CONVERSATION[1:]) == chat.render(plain, CONVERSATION[1:])
    assert chat.encode(tagged, CONVERSATION[1:]) == chat.encode(plain, CONVERSATION[1:])
    assert sum(chat.encode(tagged, CONVERSATION[1:])[1]) == 6   # Hello . <|im_end|> Four . <|im_end|>


def test_stop_ids_are_eos_and_end_of_turn(qwen, llama3):
    assert qwen.convert_ids_to_tokens(chat.stop_ids(qwen)) == ["<|endoftext|>", "<|im_end|>"]
    assert llama3.convert_ids_to_tokens(chat.stop_ids(llama3)) == ["<|end_of_text|>", "<|eot_id|>"]
    assert chat.stop_ids(data.tiny_tokenizer()) == [2]   # </s> is both
    assert chat.stop_ids(ct.qwen(template=None)) == [qwen.eos_token_id]


def test_pad_falls_back_to_eos(qwen, llama3):
    assert qwen.pad_token_id is None and chat.pad_id(qwen) == qwen.eos_token_id
    assert chat.pad_id(llama3) == llama3.convert_tokens_to_ids("<|end_of_text|>")
    assert chat.pad_id(data.tiny_tokenizer()) == 0


@pytest.mark.parametrize("make, prompt, reply", [
    (ct.qwen, "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n12+34=<|im_end|>\n"
              "<|im_start|>assistant\n", "46<|im_end|>"),
    (ct.llama3, "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n12+34=<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n", "46<|eot_id|>"),
    (data.tiny_tokenizer, "<|user|>12+34=<|assistant|>", "46</s>"),
])
def test_arithmetic_through_the_template(make, prompt, reply):
    tok = make()
    task = data.ArithmeticTask(digits=2, tokenizer=tok)
    assert task.prompt(12, "+", 34) == prompt and task.reply("46") == reply
    pairs = task.train_pairs(12)
    assert all(data.verify(p, r) == 1.0 for p, r in pairs)
    assert data.verify(prompt, "46" + reply[2:]) == 1.0 and data.verify(prompt, "47") == 0.0
    batch = data.tokenize_sft(pairs, tok, seq_len_tokens=data.seq_len_needed(pairs, tok) + 3)
    for i, (p, r) in enumerate(pairs):
        assert tok.decode(batch.labels[i][batch.loss_mask[i] == 1].tolist()) == r   # answer + end-of-turn
        n = len(chat.encode_text(tok, p + r)) - 1
        assert (batch.tokens[i, n:] == chat.pad_id(tok)).all() and batch.loss_mask[i, n:].sum() == 0


def test_verify_skips_a_leading_think_block():
    prompt = "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
    assert data.verify(prompt, "<think>\n\n</think>\n\n46<|im_end|>") == 1.0
    assert data.verify(prompt, "<think>\n12+34=45\n</think>\n\n45") == 0.0


def test_jsonl_rendered_by_the_template(tmp_path, qwen, llama3):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps({"prompt": "Hi", "response": "Hey there."}))
    for tok, eot in ((qwen, "<|im_end|>"), (llama3, "<|eot_id|>")):
        examples = data.load_jsonl(path, tok)
        assert [list(e.ids) for e in examples] == [chat.encode(tok, CONVERSATION)[0],
                                                     chat.encode_text(tok, chat.render(tok, [
                                                         {"role": "user", "content": "Hi"},
                                                         {"role": "assistant", "content": "Hey there."}]))]
        batch = data.tokenize_sft(examples, tok, seq_len_tokens=64)
        assert tok.decode(batch.labels[0][batch.loss_mask[0] == 1].tolist()) == f"Hello.{eot}Four.{eot}"
        assert tok.decode(batch.labels[1][batch.loss_mask[1] == 1].tolist()) == f"Hey there.{eot}"
        assert (batch.tokens[0, len(examples[0].ids) - 1:] == tok.eos_token_id).all()   # no pad token: eos pads


def test_row_the_template_rejects_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "Hi", "response": "Hello."}) + "\n\n" + json.dumps({"messages": CONVERSATION}) + "\n")
    with pytest.raises(chat.ChatTemplateError, match=r"data.jsonl:3: the chat template .* System role not supported"):
        data.load_jsonl(path, ct.qwen(ct.CHATML_NO_SYSTEM))


def test_no_chat_template_says_what_is_needed(tmp_path):
    tok = ct.qwen(template=None)
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "Hi", "response": "Hello."}) + "\n")
    for call in (lambda: data.load_jsonl(path, tok), lambda: data.ArithmeticTask(tokenizer=tok),
                 lambda: data.tokenize_sft([CONVERSATION], tok, seq_len_tokens=64)):
        with pytest.raises(chat.ChatTemplateError, match="has no chat_template.*tokenizer.chat_template"):
            call()


def test_tiny_template_is_the_one_path():
    """The tiny tokenizer renders its historical text through its template; masks as before."""
    tok = data.tiny_tokenizer()
    ids, target = chat.encode(tok, CONVERSATION)
    assert tok.decode(ids) == "Be brief.\n<|user|>Hi<|assistant|>Hello.</s><|user|>What is 2+2?<|assistant|>Four.</s>"
    assert tok.decode([i for i, t in zip(ids, target) if t]) == "Hello.</s>Four.</s>"
    batch = data.tokenize_sft([CONVERSATION], tok, seq_len_tokens=len(ids) - 1)
    assert torch.equal(batch.loss_mask[0], torch.tensor(target[1:], dtype=torch.float32))


def test_prompt_that_the_conversation_does_not_continue_is_refused(qwen):
    """Where the generation prompt is not how the template writes the reply, training would not
    match inference, so no mask is guessed: for a whole template, or for one row (a template that
    counts the questions up front writes the start of a two-question conversation differently)."""
    odd = ct.qwen(ct.CHATML_NO_SYSTEM.replace("'<|im_start|>' + message['role']",
                                              "'<|im_start|>' + message['role'].replace('assistant', 'bot')"))
    with pytest.raises(chat.ChatTemplateError, match="renders a reply that does not continue its generation prompt"):
        data.tokenize_sft([CONVERSATION[1:3]], odd, seq_len_tokens=64)
    counting = ct.qwen("{{ 'Users: ' + (messages|selectattr('role', 'eq', 'user')|list|length|string) + '\\n' }}"
                       + ct.CHATML_NO_SYSTEM)
    assert chat.render(counting, CONVERSATION[1:2]).startswith("Users: 1\n<|im_start|>user")
    data.tokenize_sft([CONVERSATION[1:3]], counting, seq_len_tokens=64)   # one question: prompt and reply agree
    with pytest.raises(chat.ChatTemplateError, match="example 1: the chat template writes the conversation before "
                                                     "message 1 .* differently from the prompt"):
        data.tokenize_sft([CONVERSATION[1:3], CONVERSATION[1:]], counting, seq_len_tokens=64)   # "Users: 2" vs 1
    with pytest.raises(chat.ChatTemplateError, match="example 0: message 0 is the assistant's"):
        data.tokenize_sft([CONVERSATION[2:3]], qwen, seq_len_tokens=64)


def test_rl_prompts_from_jsonl(tmp_path, llama3):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n\n"
                    + json.dumps({"messages": CONVERSATION[:2], "answer": "Hello"}) + "\n")
    prompts = data.load_prompts_jsonl(path, llama3)
    assert prompts == [("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n2+2=<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n", "4"),
                       (chat.render(llama3, CONVERSATION[:2], add_generation_prompt=True), "Hello")]
    assert data.verify(prompts[0][0], "4<|eot_id|>") == 1.0
    with pytest.raises(chat.ChatTemplateError, match=r"prompts.jsonl:3: the chat template .* System role"):
        data.load_prompts_jsonl(path, ct.qwen(ct.CHATML_NO_SYSTEM))
    path.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl:1: a prompt row is .*\"answer\": str"):
        data.load_prompts_jsonl(path, llama3)


@pytest.mark.parametrize("specials, template, eos, bos, eot", [
    (ct.CHATML_SPECIALS, ct.QWEN_TEMPLATE, "<|endoftext|>", None, "<|im_end|>"),
    (ct.LLAMA3_SPECIALS, ct.LLAMA3_TEMPLATE, "<|end_of_text|>", "<|begin_of_text|>", "<|eot_id|>"),
])
def test_byte_level_bpe(specials, template, eos, bos, eot):
    """With merges learned from the conversations themselves, the reply tokens decode to exactly the
    replies and their end-of-turn tokens, and everything else to the rest of the text."""
    conversations = [CONVERSATION, CONVERSATION[1:3], [{"role": "user", "content": "How many legs does a spider have?"},
                                                       {"role": "assistant", "content": "Eight legs.\n\nOne two three."}]]
    words = ct.build(specials, template=template, eos=eos, bos=bos)   # renders the training corpus
    tok = ct.byte_bpe(specials, template=template, eos=eos, bos=bos,
                      corpus=[chat.render(words, c) for c in conversations])
    for messages, replies in zip(conversations, (["Hello.", "Four."], ["Hello."], ["Eight legs.\n\nOne two three."])):
        ids, target = chat.encode(tok, messages)
        assert tok.decode(ids) == chat.render(tok, messages)
        assert tok.decode([i for i, t in zip(ids, target) if t]) == "".join(r + eot for r in replies)
        assert len(ids) < len(chat.render(tok, messages)) / 1.5   # merges happened: fewer tokens than characters
