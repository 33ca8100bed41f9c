"""Picking the next token on the device, and its log-probability as the trainer will score it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def pick(logits: torch.Tensor, *, temperature: float, top_p: float, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], its log-prob [B] fp32) per row of `logits` [B, vocab].

    The token: argmax at temperature 0, else a draw from softmax(logits / T) cut to the smallest set of tokens
    whose probability reaches top_p (HF's TopPLogitsWarper: the top token always stays), drawn as
    argmax(log p - log E) with E ~ Exp(1) per token (the exponential race, gpt-fast's sampler: an exact draw
    from p in a few elementwise passes, where `torch.multinomial` scans a cumulative sum per row).
    The log-prob: log softmax(logits / T) of the token, before the top-p cut (verl's convention: the trainer
    scores a sampled sequence at the sampling temperature, `rl.core.token_logprobs`); T 0 scores at T 1.
    Without a top-p cut no log p is made (`scaled_race`). Compiling that race was measured (a 1.7 B model, 512
    rows): no faster per decode step, and seconds of compile in the first call (docs/benchmarks.md,
    "grpo_iteration: fused kernels by default, and two rollout ideas that lost")."""
    if temperature == 0:
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits.float(), -1).gather(-1, token[:, None]).squeeze(-1)
    draws = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_(generator=generator)
    if top_p >= 1.0:
        return scaled_race(logits, draws, temperature)
    logp = torch.log_softmax(logits.float() / temperature, -1)
    sorted_p, order = logp.exp().sort(-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p   # mass of the tokens ranked above each one
    cut = torch.zeros_like(logp, dtype=torch.bool).scatter_(-1, order, before >= top_p)
    token = race(logp.masked_fill(cut, float("-inf")), draws)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def scaled_race(logits: torch.Tensor, draws: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax(logits / T - log E), that token's log softmax(logits / T)) per row, with `draws` E ~ Exp(1)
    (overwritten): `race` over logits / T, not log p (argmax does not move when a row's log-sum-exp is subtracted
    from all of it), so log p is never made."""
    x = logits.float() / temperature
    token = race(x, draws)
    return token, x.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(x, -1)


def race(keep: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """argmax(keep - log E) per row, with `draws` E ~ Exp(1) (overwritten). A draw of exactly 0 (float rounding of a
    tiny exponential, which torch's sampler can return) is clamped to the smallest normal float: log 0 = -inf would
    make that token win whatever its probability, and a token cut by top-p (-inf) would give -inf + inf = NaN."""
    return (keep - draws.clamp_(min=torch.finfo(draws.dtype).tiny).log_()).argmax(-1)


@dataclass
class Sampler:
    """One rollout call's draws: `pick` at the call's temperature and top_p, from a generator seeded with `seed`; or,
    with `kernel` and top_p 1, `draw.draw` (one Triton kernel a step, `DecodeConfig.sampler="triton"`), its Philox
    counter the draws made so far. Either way a call's tokens are a function of its seed."""

    temperature: float
    top_p: float
    seed: int
    device: torch.device
    kernel: bool = False
    generator: torch.Generator = field(init=False)
    draws: int = field(init=False, default=0)
    """Calls so far (the kernel's step)."""

    def __post_init__(self):
        self.generator = torch.Generator(device=self.device).manual_seed(self.seed)

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token [B], its log-prob [B] fp32) per row of `logits` [B, vocab] (`pick`)."""
        self.draws += 1
        if self.kernel and self.top_p >= 1.0:
            from .draw import draw
            return draw(logits, temperature=self.temperature, seed=self.seed, step=self.draws - 1)
        return pick(logits, temperature=self.temperature, top_p=self.top_p, generator=self.generator)
