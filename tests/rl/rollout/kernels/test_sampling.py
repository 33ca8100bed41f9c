"""rl.rollout.kernels.sampling.pick samples the law it states (softmax(logits / T) cut to the top-p set) and returns
each token's log-prob at T, before the cut."""
import math

import pytest
import torch

from mfsdp_kit.rl.rollout.kernels.sampling import pick, race, scaled_race


@pytest.mark.parametrize("top_p", [0.9, 1.0])
def test_draws_follow_softmax_over_t_cut_to_top_p(top_p):
    """10k draws at T 0.7 / top_p 0.9 against the truncated law: no draw outside the set, and a chi-square test
    at alpha 1e-3 (Wilson-Hilferty's quantile). Temperature or top-p ignored fails it. top_p 1: the race without
    a cut (`scaled_race`, the path the engine compiles on a GPU)."""
    logits = torch.randn(256, generator=torch.Generator().manual_seed(0)) * 1.8
    probs = torch.softmax(logits / 0.7, -1)
    sorted_p, order = probs.sort(descending=True)
    keep = order[(sorted_p.cumsum(0) - sorted_p) < top_p]
    expected = torch.zeros_like(probs)
    expected[keep] = probs[keep] / probs[keep].sum()
    assert 2 < len(keep) < len(probs) // 2 if top_p < 1 else len(keep) == len(probs)   # the cut matters, or none
    draws, logp = pick(logits.expand(10_000, -1), temperature=0.7, top_p=top_p,
                       generator=torch.Generator().manual_seed(1))
    assert_draws_follow(draws, expected)
    torch.testing.assert_close(logp, torch.log_softmax(logits / 0.7, -1)[draws], rtol=0, atol=1e-6)


def assert_draws_follow(draws: torch.Tensor, expected: torch.Tensor) -> None:
    """No draw where `expected` (a law over the vocabulary) is 0, and a chi-square test at alpha 1e-3 (Wilson-Hilferty's
    quantile; cells expecting fewer than 5 draws pooled)."""
    counts = torch.bincount(draws.cpu(), minlength=len(expected)).double()
    expected = expected.cpu().double()
    assert counts[expected == 0].sum() == 0, "a token outside the law's support was drawn"
    e = expected * len(draws)
    big = e >= 5
    observed = torch.cat([counts[big], counts[~big & (expected > 0)].sum().reshape(1)])
    wanted = torch.cat([e[big], e[~big & (expected > 0)].sum().reshape(1)])
    observed, wanted = observed[wanted > 0], wanted[wanted > 0]
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    df = len(wanted) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < critical, (chi2, critical, df)


def test_temperature_zero_is_greedy_scored_at_one():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    token, logp = pick(logits, temperature=0, top_p=0.5, generator=None)
    assert torch.equal(token, logits.argmax(-1))
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1).max(-1).values)


def test_same_generator_seed_same_draws():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(3))
    a = pick(logits, temperature=1.0, top_p=0.95, generator=torch.Generator().manual_seed(4))[0]
    b = pick(logits, temperature=1.0, top_p=0.95, generator=torch.Generator().manual_seed(4))[0]
    c = pick(logits, temperature=1.0, top_p=0.95, generator=torch.Generator().manual_seed(5))[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_zero_draw_does_not_win_the_race():
    """A draw of exactly 0 at a token of probability 0 (keep -inf: cut by top-p, or underflowed) must not pick it:
    unclamped, log 0 = -inf makes its key -inf + inf = NaN, which argmax takes."""
    keep = torch.log(torch.tensor([[0.7, 0.3, 0.0], [0.5, 0.5, 0.0]]))
    draws = torch.tensor([[1.0, 1.0, 0.0], [1.0, 2.0, 0.0]])
    unclamped = (keep - draws.clone().log()).argmax(-1)
    assert unclamped.tolist() == [2, 2]                      # the bug: NaN wins
    assert race(keep.clone(), draws).tolist() == [0, 0]


def test_the_race_without_a_cut_is_the_race_over_log_p():
    """`scaled_race` skips making log p: the same tokens as `race` over log_softmax(logits / T) with the same
    draws, and the same log-probs."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(64, 1000, generator=g).to(torch.bfloat16) * 3
    draws = torch.empty(64, 1000).exponential_(generator=g)
    logp = torch.log_softmax(logits.float() / 0.8, -1)
    token, scored = scaled_race(logits, draws.clone(), 0.8)
    assert torch.equal(token, race(logp, draws.clone()))
    torch.testing.assert_close(scored, logp.gather(-1, token[:, None]).squeeze(-1), rtol=0, atol=1e-5)

