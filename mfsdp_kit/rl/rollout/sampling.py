"""Picking the next token on the device, and its log-probability as the trainer will score it."""
from __future__ import annotations

import torch


def pick(logits: torch.Tensor, *, temperature: float, top_p: float, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], its log-prob [B] fp32) per row of `logits` [B, vocab].

    The token: argmax at temperature 0, else a draw from softmax(logits / T) cut to the smallest set of tokens
    whose probability reaches top_p (HF's TopPLogitsWarper: the top token always stays), drawn as
    argmax(log p - log E) with E ~ Exp(1) per token (the exponential race, gpt-fast's sampler: an exact draw
    from p in a few elementwise passes, where `torch.multinomial` scans a cumulative sum per row).
    The log-prob: log softmax(logits / T) of the token, before the top-p cut (verl's convention: the trainer
    scores a sampled sequence at the sampling temperature, `rl.core.token_logprobs`); T 0 scores at T 1."""
    logp = torch.log_softmax(logits.float() / (temperature or 1.0), -1)
    if temperature == 0:
        token = logits.argmax(-1)
    else:
        keep = logp
        if top_p < 1.0:
            sorted_p, order = logp.exp().sort(-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p   # mass of the tokens ranked above each one
            cut = torch.zeros_like(logp, dtype=torch.bool).scatter_(-1, order, before >= top_p)
            keep = logp.masked_fill(cut, float("-inf"))
        token = race(keep, torch.empty_like(logp).exponential_(generator=generator))
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def race(keep: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """argmax(keep - log E) per row, with `draws` E ~ Exp(1) (overwritten). A draw of exactly 0 (float rounding of a
    tiny exponential, which torch's sampler can return) is clamped to the smallest normal float: log 0 = -inf would
    make that token win whatever its probability, and a token cut by top-p (-inf) would give -inf + inf = NaN."""
    return (keep - draws.clamp_(min=torch.finfo(draws.dtype).tiny).log_()).argmax(-1)
