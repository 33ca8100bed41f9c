"""Chat templates: conversations rendered by the tokenizer's own `chat_template`, the assistant
tokens a loss trains on, and the token ids that end a reply.

The naive way formats every conversation one fixed way ("<|user|>...<|assistant|>...</s>"): a
chat model fine-tuned like that learns a prompt format it never saw and an end-of-turn token it
never emits, and nothing fails. Here the template that came with the tokenizer (jinja, run by
`tokenizer.apply_chat_template`) renders everything: SFT conversations, RL and evaluation
prompts. The kit's tiny model carries its format as such a template (`models.tiny.CHAT_TEMPLATE`),
so it takes the same path as a user's Qwen or Llama.

Which tokens are the assistant's? A template is free text, so the kit asks it. The whole
conversation is rendered once (the training sequence). For the k-th message, an assistant turn,
the messages before it are rendered with the generation prompt (P_k): what the model sees when it
answers. P_k must be a prefix of the whole text (else training would not match inference); the
turn's tokens run from there through the first end-of-turn token (ChatML: "<|im_start|>assistant\n"
is P_k's end, "46<|im_end|>" the reply; the "\n" after it is the template's, not the model's).
Qwen3's template, which writes an empty <think></think> block only into the last turn, works the
same way: the block is part of what the model emits there. A template without an end-of-turn
special token ends the turn where the messages through it (F_k) end, F_k then also having to be
a prefix. A template that marks the assistant text with {% generation %} ... {% endgeneration %}
is trusted instead (`return_assistant_tokens_mask`).
"""
from __future__ import annotations

import re

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template, or its template cannot render a conversation."""


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def require_template(tokenizer) -> None:
    """Raise `ChatTemplateError` saying what is needed when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"the tokenizer of {_name(tokenizer)!r} has no chat_template: the kit renders SFT data and "
            "prompts with the tokenizer's own template (tokenizer.apply_chat_template), so that training "
            "uses the format and end-of-turn token the model answers in. Use the chat/instruct variant's "
            "tokenizer (tokenizer_config.json with a \"chat_template\", or chat_template.jinja), or set "
            "tokenizer.chat_template to the jinja template your model was trained with before passing it "
            "(mfsdp_kit.models.tiny.CHAT_TEMPLATE shows the shape: user, assistant and end-of-turn text)")


def render(tokenizer, messages: list[dict], *, add_generation_prompt: bool = False, where: str | None = None) -> str:
    """The conversation as text, exactly as the tokenizer's template writes it. With `where`
    (e.g. "data.jsonl:7"), a template's refusal is a `ChatTemplateError` starting with it."""
    import jinja2
    require_template(tokenizer)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as e:
        if where is None:
            raise
        raise ChatTemplateError(f"{where}: the chat template of {_name(tokenizer)!r} cannot render this "
                                f"conversation: {e}") from None


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of rendered text; the template writes bos itself where it wants one."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def pad_id(tokenizer) -> int:
    """The id to pad with: pad, else eos (Llama 3 and Qwen3 tokenizers have no pad token), else 0.
    Padding never reaches the loss: the loss mask is 0 wherever the target is not a reply token."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


def _special_ids(tokenizer) -> set[int]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", False)}


def _probe(tokenizer, reply: str = "42") -> tuple[str, str]:
    """(generation prompt, rendered reply) of a one-question conversation answered with `reply`."""
    question = [{"role": "user", "content": "1+41="}]
    prompt = render(tokenizer, question, add_generation_prompt=True)
    full = render(tokenizer, question + [{"role": "assistant", "content": reply}])
    if not full.startswith(prompt):
        raise ChatTemplateError(f"the chat template of {_name(tokenizer)!r} renders a reply that does not "
                                f"continue its generation prompt: {prompt!r} vs {full!r}")
    return prompt, full[len(prompt):]


def end_of_turn_id(tokenizer) -> int | None:
    """The first special token the template writes after the assistant's text (ChatML: <|im_end|>,
    Llama 3: <|eot_id|>, the tiny format: </s>), or None if it writes none."""
    _, reply = _probe(tokenizer)
    tail = reply[reply.rindex("42") + 2:]
    specials = _special_ids(tokenizer)
    return next((i for i in encode_text(tokenizer, tail) if i in specials), None)


def stop_ids(tokenizer) -> list[int]:
    """Token ids that end a reply: eos and, with a chat template, its end-of-turn token."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    if getattr(tokenizer, "chat_template", None):
        eot = end_of_turn_id(tokenizer)
        ids += [eot] if eot is not None and eot not in ids else []
    return ids


def reply_frame(tokenizer, *, system: str | None = None) -> tuple[str, str, str, str]:
    """(before, after) the user's text in a one-turn prompt and (before, after) the reply's text in
    the rendered reply, cut after the end-of-turn token: the tiny format gives
    ("<|user|>", "<|assistant|>", "", "</s>"). Filled in by string formatting, far cheaper than one
    template call per example; `data.ArithmeticTask` checks it against a direct rendering."""
    q, a = "\x02Q\x03", "\x02A\x03"
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q}]
    prompt = render(tokenizer, messages, add_generation_prompt=True)
    full = render(tokenizer, messages + [{"role": "assistant", "content": a}])
    if not full.startswith(prompt) or prompt.count(q) != 1 or full[len(prompt):].count(a) != 1:
        raise ChatTemplateError(f"the chat template of {_name(tokenizer)!r} does not write a message's text "
                                f"verbatim after its generation prompt: {prompt!r}, {full!r}")
    before_q, after_q = prompt.split(q)
    before_a, after_a = full[len(prompt):].split(a)
    eot = end_of_turn_id(tokenizer)
    if eot is not None:
        mark = tokenizer.convert_ids_to_tokens(eot)
        if mark in after_a:
            after_a = after_a[:after_a.index(mark) + len(mark)]
    return before_q, after_q, before_a, after_a


def _with_tags(tokenizer, messages: list[dict]) -> tuple[list[int], list[bool]]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def _prefix_tokens(tokenizer, ids: list[int], text: str, *, where: str, what: str) -> int:
    """len(tokens of `text`), checked to be the first tokens of the whole conversation `ids`."""
    head = encode_text(tokenizer, text)
    if head != ids[:len(head)]:
        raise ChatTemplateError(f"{where}: {what} does not tokenize as a prefix of the whole conversation "
                                f"(its text does, but a token spans the boundary); a template that marks "
                                "the assistant text with {% generation %} ... {% endgeneration %} avoids this")
    return len(head)


def encode(tokenizer, messages: list[dict], *, where: str = "conversation") -> tuple[list[int], list[bool]]:
    """(token ids of the whole conversation, per token: is it the assistant's?) for training.

    Every assistant turn counts, its end-of-turn token included (see the module docstring for
    how the turns are found). Errors start with `where` (e.g. "data.jsonl:7")."""
    import jinja2
    require_template(tokenizer)
    try:
        if GENERATION_TAG.search(tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""):
            return _with_tags(tokenizer, messages)
        full = render(tokenizer, messages)
        ids = encode_text(tokenizer, full)
        target = [False] * len(ids)
        eot = end_of_turn_id(tokenizer)
        mark = None if eot is None else tokenizer.convert_ids_to_tokens(eot)
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            if k == 0:
                raise ChatTemplateError(f"{where}: message 0 is the assistant's; a reply needs a system or "
                                        "user message before it to be rendered as an answer")
            prompt = render(tokenizer, messages[:k], add_generation_prompt=True)
            if not full.startswith(prompt):
                raise ChatTemplateError(
                    f"{where}: the chat template writes the conversation before message {k} (assistant) "
                    "differently from the prompt it renders for answering it, so the reply cannot be "
                    "located; a template that marks the assistant text with {% generation %} ... "
                    "{% endgeneration %} avoids this")
            stop = -1 if mark is None else full.find(mark, len(prompt))
            if stop >= 0:
                end = stop + len(mark)
            else:   # no end-of-turn token: the turn ends where the messages through it end
                through = render(tokenizer, messages[:k + 1])
                if not full.startswith(through):
                    raise ChatTemplateError(f"{where}: the chat template writes message {k} (assistant) "
                                            "differently once the rest of the conversation follows")
                end = len(through)
            start = _prefix_tokens(tokenizer, ids, prompt, where=where, what=f"the prompt of message {k}")
            stop_tok = _prefix_tokens(tokenizer, ids, full[:end], where=where, what=f"message {k}")
            target[start:stop_tok] = [True] * (stop_tok - start)
        return ids, target
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"{where}: the chat template of {_name(tokenizer)!r} cannot render this "
                                f"conversation: {e}") from None
