"""rl.advantages: each estimator against a small case computed by hand (to 1e-6), and an unknown one named."""
import pytest
import torch

from mfsdp_kit.config import ConfigError
from mfsdp_kit.rl import advantages

REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0,   2.0, 2.0, 0.0, 1.0])   # two groups of 4


def test_grpo_normalises_within_each_group():
    # group 1: mean 0.25, population std sqrt(3)/4; group 2: mean 1.25, std sqrt(11)/4
    s1, s2 = 3 ** 0.5 / 4, 11 ** 0.5 / 4
    want = [0.75 / s1, -0.25 / s1, -0.25 / s1, -0.25 / s1, 0.75 / s2, 0.75 / s2, -1.25 / s2, -0.25 / s2]
    got = advantages.estimate(REWARDS, group_size=4, estimator="grpo")
    assert torch.allclose(got, torch.tensor(want), atol=1e-5)   # eps = 1e-6 in the denominator


def test_rloo_subtracts_the_mean_of_the_others():
    want = [1.0, -1 / 3, -1 / 3, -1 / 3,   2 - 1.0, 2 - 1.0, 0 - 5 / 3, 1 - 4 / 3]
    got = advantages.estimate(REWARDS, group_size=4, estimator="rloo")
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)
    assert torch.equal(advantages.rloo(torch.tensor([3.0, 5.0]), group_size=1), torch.zeros(2))


def test_reinforce_pp_whitens_over_the_batch_not_the_group():
    mean = 6 / 8
    std = ((REWARDS - mean) ** 2).mean().sqrt()                # population std over all 8: sqrt(0.6875)
    want = (REWARDS - mean) / (std + 1e-6)
    got = advantages.estimate(REWARDS, group_size=4, estimator="reinforce++")
    assert torch.allclose(got, want, atol=1e-6) and abs(got.mean().item()) < 1e-6
    assert got[4] == got[5] and got[0] < got[4]                 # rewards compared across groups: 1 < 2


def test_an_unknown_estimator_is_named():
    with pytest.raises(ConfigError, match="advantage_estimator='ppo'"):
        advantages.estimate(REWARDS, group_size=4, estimator="ppo")


# ---- GAE (with a critic): [n, seq] in the training batch's layout -------------------------------------------------
# Two rows of 7 positions: row 0 has completion tokens at positions 2, 3, 4 (3 steps), row 1 at 1, 2 (2 steps);
# the values are the critic's at every position (those outside the mask must not matter).
MASK = torch.tensor([[0, 0, 1, 1, 1, 0, 0],
                     [0, 1, 1, 0, 0, 0, 0]], dtype=torch.float32)
VALUES = torch.tensor([[9.0, 9.0, 0.5, 0.2, 0.7, 9.0, 9.0],
                       [9.0, 0.3, -0.4, 9.0, 9.0, 9.0, 9.0]])
OUTCOME = torch.tensor([1.0, -2.0])


def test_the_outcome_reward_lands_on_the_last_completion_token():
    want = torch.zeros(2, 7)
    want[0, 4], want[1, 2] = 1.0, -2.0
    assert torch.equal(advantages.outcome_rewards(OUTCOME, MASK), want)
    assert torch.equal(advantages.outcome_rewards(torch.tensor([5.0]), torch.zeros(1, 3)), torch.zeros(1, 3))


def gae_by_hand(gamma: float, lam: float) -> torch.Tensor:
    """The recursion written out step by step for both rows (V after the last step = 0)."""
    g, gl = gamma, gamma * lam
    d0 = [0 + g * 0.2 - 0.5, 0 + g * 0.7 - 0.2, 1.0 + g * 0 - 0.7]            # row 0, steps at 2, 3, 4
    a0_4 = d0[2]
    a0_3 = d0[1] + gl * a0_4
    a0_2 = d0[0] + gl * a0_3
    d1 = [0 + g * -0.4 - 0.3, -2.0 + g * 0 - -0.4]                            # row 1, steps at 1, 2
    a1_2 = d1[1]
    a1_1 = d1[0] + gl * a1_2
    return torch.tensor([[0, 0, a0_2, a0_3, a0_4, 0, 0], [0, a1_1, a1_2, 0, 0, 0, 0]])


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 0.0), (0.5, 1.0)])
def test_gae_matches_the_recursion_by_hand(gamma, lam):
    adv, ret = advantages.gae(advantages.outcome_rewards(OUTCOME, MASK), VALUES, MASK, gamma=gamma, lam=lam)
    want = gae_by_hand(gamma, lam)
    assert torch.allclose(adv, want, atol=1e-6), (adv, want)
    assert torch.allclose(ret, (want + VALUES) * MASK, atol=1e-6)           # returns = advantages + values


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_gae_at_lambda_one_is_the_discounted_return_minus_the_value(gamma):
    adv, _ = advantages.gae(advantages.outcome_rewards(OUTCOME, MASK), VALUES, MASK, gamma=gamma, lam=1.0)
    want = torch.zeros(2, 7)
    for t, k in zip((2, 3, 4), (2, 1, 0)):                                  # k steps before the reward
        want[0, t] = gamma ** k * 1.0 - VALUES[0, t]
    for t, k in zip((1, 2), (1, 0)):
        want[1, t] = gamma ** k * -2.0 - VALUES[1, t]
    assert torch.allclose(adv, want, atol=1e-6)


def test_a_gap_in_the_mask_is_no_step():
    """A masked-out position inside a completion (a tool's output in a multi-turn reply) is skipped: the chain runs
    from the step before it to the step after, as if it were not there."""
    mask = torch.tensor([[1, 0, 1.0]])
    values = torch.tensor([[0.25, 7.0, 0.5]])
    adv, _ = advantages.gae(advantages.outcome_rewards(torch.tensor([1.0]), mask), values, mask, gamma=0.9, lam=0.5)
    a2 = 1.0 - 0.5
    a0 = (0.9 * 0.5 - 0.25) + 0.9 * 0.5 * a2
    assert torch.allclose(adv, torch.tensor([[a0, 0.0, a2]]), atol=1e-6)


def test_whiten_uses_only_the_completion_tokens():
    x = torch.tensor([[100.0, 1.0, 3.0], [-50.0, 5.0, 7.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1.0]])
    on = torch.tensor([1.0, 3.0, 5.0, 7.0])
    std = ((on - 4) ** 2).mean().sqrt()
    want = torch.tensor([[0, -3, -1], [0, 1, 3]]) / (std + 1e-6)
    assert torch.allclose(advantages.whiten(x, mask), want, atol=1e-6)
