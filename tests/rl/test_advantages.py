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
