"""Picking the next token on the device, and its log-probability as the trainer will score it."""
from __future__ import annotations

import torch


def pick(logits: torch.Tensor, *, temperature: float, top_p: float, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], its log-prob [B] fp32) per row of `logits` [B, vocab].

    The token: argmax at temperature 0, else a draw from softmax(logits / T) cut to the smallest set of tokens
    whose probability reaches top_p (HF's TopPLogitsWarper: the top token always stays).
    The log-prob: log softmax(logits / T) of the token, before the top-p cut (verl's convention: the trainer
    scores a sampled sequence at the sampling temperature, `rl.core.token_logprobs`); T 0 scores at T 1."""
    scaled = logits.float() / (temperature or 1.0)
    logp = torch.log_softmax(scaled, -1)
    if temperature == 0:
        token = logits.argmax(-1)
    else:
        probs = logp.exp()
        if top_p < 1.0:
            sorted_p, order = probs.sort(-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p   # mass of the tokens ranked above each one
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(before >= top_p, 0.0))
        token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)
