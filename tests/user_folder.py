"""A user's Hugging Face folder that the kit did not make: `transformers` writes the model (its own random init)
and `tokenizers` trains a byte-level BPE with a real chat template, as a downloaded Llama 3 or Qwen2.5 brings.

    python -m tests.user_folder runs/user_llama3 --style llama3   # Llama 3: header tokens, bos, no pad token
    python -m tests.user_folder runs/user_qwen --style qwen       # Qwen3 with Qwen2.5's ChatML (a system turn)

`make test` runs 02_sft and 05_grpo with `MFSDP_MODEL` set to the Llama 3 one: the notebooks' prompts
come from its template, their lengths from what it needs, and GRPO samples with a tokenizer that has no pad token.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from mfsdp_kit.models import archs
from tests import chat_tokenizers as ct

STYLES = {   # style -> (architecture, tokenizer from the corpus)
    "llama3": ("LlamaForCausalLM", lambda corpus: ct.byte_bpe(ct.LLAMA3_SPECIALS, template=ct.LLAMA3_TEMPLATE,
                                                              eos="<|end_of_text|>", bos="<|begin_of_text|>",
                                                              corpus=corpus)),
    "qwen": ("Qwen3ForCausalLM", lambda corpus: ct.byte_bpe(ct.CHATML_SPECIALS, template=ct.QWEN_TEMPLATE,
                                                            eos="<|endoftext|>", corpus=corpus)),
}
VOCAB = 512
"""The model's vocabulary: the BPE's 400 tokens, padded as checkpoints pad theirs."""


def corpus() -> list[str]:
    """What the BPE learns its merges from: sums written out, and a chat turn."""
    return [f"{a}+{b}={a + b}" for a in range(100) for b in range(0, 100, 7)] + \
        ["You are a helpful assistant. What is 3+4? The answer is 7."] * 20


def write(path, *, style: str) -> Path:
    """The folder at `path`: config, safetensors weights, tokenizer files with the chat template."""
    if style not in STYLES:
        raise ValueError(f"style={style!r} is not allowed; allowed: {' | '.join(STYLES)}")
    arch, make_tokenizer = STYLES[style]
    tok = make_tokenizer(corpus())
    if len(tok) > VOCAB:
        raise ValueError(f"the {style} tokenizer has {len(tok)} tokens, more than the model's {VOCAB}")
    path = archs.write_tiny(arch, path, vocab_size=VOCAB)
    tok.save_pretrained(path)   # over write_tiny's word-level tokenizer
    for name in ("config.json", "generation_config.json"):   # the ids of this tokenizer's bos and eos, as a real
        file = path / name                                    # checkpoint's configs carry them
        config = json.loads(file.read_text())
        config.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        file.write_text(json.dumps(config, indent=2))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--style", default="llama3", choices=list(STYLES))
    args = ap.parse_args()
    print(write(args.path, style=args.style))


if __name__ == "__main__":
    main()
