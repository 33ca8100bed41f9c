"""Batches of random tokens whose sequences vary in length, as researchers' data does (packing's tests and bench).

Two mixes from issue #38:
- "sft": lengths log-normal with median 300 tokens (sigma 1), cut to [8, 2048];
- "rl": a 128-token prompt (out of the loss) and a response uniform in [16, 1024] tokens (in it).
A sequence of L tokens sits in a padded row: positions [0, L) hold tokens, the loss covers its reply
(from `prompt` on; SFT: the last 60 %), the rest is token 0 with the loss mask 0.
"""
from __future__ import annotations

import math

import torch

from ..train.data import Batch
from ..fieldtypes import bad_value

MIXES = ("sft", "rl")


def lengths(mix: str, n: int, *, seed: int = 0, max_tokens: int = 2048) -> list[tuple[int, int]]:
    """n (prompt tokens, total tokens) pairs of `mix`, deterministic by seed."""
    g = torch.Generator().manual_seed(seed)
    if mix == "sft":
        total = torch.exp(math.log(300) + torch.randn(n, generator=g)).round().clamp(8, max_tokens).long().tolist()
        return [(t - max(1, int(0.6 * t)), t) for t in total]
    if mix == "rl":
        prompt = min(128, max_tokens // 2)
        top = min(1024, max_tokens - prompt)
        reply = torch.randint(min(16, top), top + 1, (n,), generator=g).tolist()
        return [(prompt, prompt + r) for r in reply]
    raise bad_value("mix", mix, " | ".join(MIXES))


def batch(pairs: list[tuple[int, int]], *, seq_len_tokens: int, vocab_size: int, seed: int = 0) -> Batch:
    """A padded Batch [len(pairs), seq_len_tokens] of random tokens: row i holds total_i tokens, the loss
    on positions [prompt_i, total_i)."""
    if max(t for _, t in pairs) > seq_len_tokens:
        raise bad_value("seq_len_tokens", seq_len_tokens, f">= the longest sequence, {max(t for _, t in pairs)}")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (len(pairs), seq_len_tokens + 1), generator=g)
    pos = torch.arange(seq_len_tokens + 1)
    total = torch.tensor([t for _, t in pairs]).unsqueeze(1)
    prompt = torch.tensor([p for p, _ in pairs]).unsqueeze(1)
    ids = torch.where(pos <= total, ids, 0)
    mask = ((pos[:-1] >= prompt) & (pos[:-1] < total)).float()
    return Batch(ids[:, :-1].clone(), ids[:, 1:].clone(), mask)


def real_tokens(b: Batch) -> int:
    """Tokens up to each sequence's last loss token: what a packed run computes."""
    from ..train.packing import loss_lengths
    return sum(loss_lengths(b))
