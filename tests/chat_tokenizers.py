"""Small tokenizers with real chat templates, built with `tokenizers` (no download).

Words of letters are one token, every digit, space, newline and punctuation mark is one token,
and the special tokens are added tokens, so a test can write the expected tokens by hand.
"""
import re

QWEN_TEMPLATE = (  # Qwen2.5's ChatML template without tools: a default system turn when none is given
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CHATML_TAGGED = (  # the same format, the assistant text marked for return_assistant_tokens_mask
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CHATML_NO_SYSTEM = (  # a template that refuses system messages, as Gemma's does
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

LLAMA3_TEMPLATE = (  # Meta-Llama-3-8B-Instruct's template
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

QWEN3_TEMPLATE = (  # Qwen3's logic without tools: an empty think block only in a reply after the last question
    "{%- set ns = namespace(last_query_index=0) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and loop.index0 > ns.last_query_index and loop.last %}"
    "{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message.content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}")

PLAIN_TEMPLATE = (  # no end-of-turn token at all
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
WORDS = ("system user assistant You are a helpful Be brief Hi Hello Hey there What is How many legs does spider have "
         "eight Four One two three")
PIECE = r"[A-Za-z]+|[^A-Za-z]"


def pieces(text: str) -> list[str]:
    return re.findall(PIECE, text)


def build(specials: list[str], *, template: str | None, eos: str, bos: str | None = None, pad: str | None = None,
          added: tuple[str, ...] = ()):
    """A PreTrainedTokenizerFast over WORDS, digits and punctuation, with `specials` as special added
    tokens and `added` as ordinary added tokens (as Qwen3's <think> and </think> are)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = ["<unk>"] + specials + sorted(set(WORDS.split())) + list("0123456789 \n.,?!:=+-*'")
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tok.add_tokens(list(added))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, pad_token=pad, unk_token="<unk>",
                                   chat_template=template, clean_up_tokenization_spaces=False)


def qwen(template: str | None = QWEN_TEMPLATE):
    """Qwen-style: ChatML, eos <|endoftext|> (the base model's), no pad token."""
    return build(CHATML_SPECIALS, template=template, eos="<|endoftext|>")


def qwen3():
    """Qwen3-style: ChatML with think blocks, eos <|im_end|> (the instruct model's), no pad token."""
    return build(CHATML_SPECIALS, template=QWEN3_TEMPLATE, eos="<|im_end|>", added=("<think>", "</think>"))


def llama3(template: str | None = LLAMA3_TEMPLATE):
    """Llama-3-style: header tokens, bos <|begin_of_text|>, eos <|end_of_text|>, no pad token."""
    return build(LLAMA3_SPECIALS, template=template, eos="<|end_of_text|>", bos="<|begin_of_text|>")


def byte_bpe(specials: list[str], *, template: str, eos: str, corpus: list[str], bos: str | None = None):
    """A byte-level BPE (Qwen's and Llama 3's kind: merges can join a newline and a word) trained on
    `corpus` in milliseconds, with `specials` as added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, chat_template=template,
                                   clean_up_tokenization_spaces=False)
