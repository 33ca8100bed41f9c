"""The `transformers` rollout backend: an HF model per rank, refreshed in place from the chunks (`backend.refresh`),
sampled by `generate`: any causal LM, the reference the kit's engine (`engine.ContinuousRollout`) is tested against.
"""
from __future__ import annotations

import torch

from ...train import chat
from ...train.generate import cut_at_stop
from . import backend
from .backend import Completions


class HFRollout:
    """An HF causal LM on this rank's device that samples with `generate` (KV cache, top-p)."""

    def __init__(self, hf_model, tokenizer):
        self.model, self.tokenizer = hf_model.eval(), tokenizer

    def refresh(self, chunks, bridge) -> dict:
        """Copy the current training weights in (every chunk: `backend.refresh`); returns {"seconds", "bytes",
        "tensors", ...}."""
        return backend.refresh(self.model, chunks, bridge)

    @torch.no_grad()
    def sample(self, prompts: list[str], *, n: int, max_new_tokens: int, temperature: float, top_p: float,
               seed: int) -> Completions:
        """n completions (token ids, cut after the first stop id: eos or the template's end-of-turn) per
        prompt, in prompt-major order, with each token's log-prob at the sampling temperature (`sampling.pick`'s
        convention). A tokenizer without a pad token pads with eos (`chat.pad_id`).

        `top_k=0` turns off transformers' default top-k of 50, so top_p alone truncates."""
        if not prompts:
            return Completions([], logprobs=[])
        rows = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        enc = left_padded(rows, pad_id=chat.pad_id(self.tokenizer), device=self.model.device)
        torch.manual_seed(seed)  # TP ranks of one replica draw the same samples
        stops = chat.stop_ids(self.tokenizer)
        out = self.model.generate(**enc, do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                                  max_new_tokens=max_new_tokens, num_return_sequences=n,
                                  eos_token_id=stops, pad_token_id=chat.pad_id(self.tokenizer),
                                  output_logits=True, return_dict_in_generate=True)
        new = out.sequences[:, enc["input_ids"].shape[1]:]
        logp = torch.stack(out.logits, 1).float().div(temperature).log_softmax(-1).gather(-1, new[..., None])[..., 0]
        tokens = [cut_at_stop(row, stops) for row in new.tolist()]
        return Completions(tokens, logprobs=[lp[:len(t)] for lp, t in zip(logp.tolist(), tokens)])


def left_padded(rows: list[list[int]], *, pad_id: int, device) -> dict[str, torch.Tensor]:
    """`input_ids` and `attention_mask` [len(rows), longest], each row right-aligned (generation appends on the
    right) after `pad_id`s. Padded here, not by the tokenizer: `tokenizer(..., padding=True)` refuses a tokenizer
    without a pad token (Llama 3's), and setting its `padding_side` would change the caller's tokenizer."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = torch.tensor(row, dtype=torch.long), 1
    return dict(input_ids=ids.to(device), attention_mask=mask.to(device))
