"""REINFORCE++ (rl.algorithms.reinforce_pp): its advantages against batches computed by hand, its config's one
estimator, and on 2 gloo ranks an iteration that trains on exactly those advantages, then iterations of the loop."""
import math

import pytest
import torch

from mfsdp_kit.config import ConfigError
from mfsdp_kit.rl.algorithms import GRPO, GRPOConfig, REINFORCE_PP, ReinforcePPConfig, of
from tests.dist import launch
from tests.rl.algorithms.test_rloo import kept


def test_rewards_are_whitened_over_the_batch():
    # mean 11/12, population variance 101/144: A = (12 r - 11) / sqrt(101)
    cfg = ReinforcePPConfig(samples_per_prompt=3)
    assert of(cfg) is REINFORCE_PP
    got = REINFORCE_PP.advantages(kept([1.0, 0.0, 0.0, 2.0, 2.0, 0.5], 3), cfg).advantages
    assert torch.allclose(got, torch.tensor([1.0, -11, -11, 13, 13, -5]) / 101 ** 0.5, atol=1e-5)


def test_a_group_that_scored_alike_still_moves():
    # groups of 2: all right, all wrong, split. Over the batch: mean 0.5, std 0.5 -> +-1; GRPO gives the first two 0
    rewards = [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    got = REINFORCE_PP.advantages(kept(rewards, 2), ReinforcePPConfig(samples_per_prompt=2)).advantages
    assert torch.allclose(got, torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0]), atol=1e-5)
    grpo = GRPO.advantages(kept(rewards, 2), GRPOConfig(samples_per_prompt=2)).advantages
    assert torch.allclose(grpo, torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -1.0]), atol=1e-5)


def test_the_config_is_batch_whitening_only():
    assert ReinforcePPConfig().advantage_estimator == "reinforce++"
    with pytest.raises(ConfigError, match="advantage_estimator='rloo' is not allowed; allowed: 'reinforce\\+\\+'"):
        ReinforcePPConfig(advantage_estimator="rloo")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return launch.run("scenarios_algorithms:critic_free_end_to_end", workdir=str(tmp_path_factory.mktemp("rpp")),
                      algorithm="reinforce++")


def test_an_iteration_trains_on_the_batch_whitened_advantages(run):
    """At one optimizer step the ratio is 1 and the loss is -sum_i A_i |o_i| / sum_i |o_i|: the whitened advantages'
    value (raised to 0, `min_advantage`), not GRPO's."""
    assert run["name"] == "reinforce++" and run["reward_of_iteration"][0] == run["reward_of_iteration"][1]
    adv, rewards = torch.tensor(run["advantages"]), torch.tensor(run["rewards"])
    whitened = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
    assert torch.allclose(adv, whitened.clamp(min=0), atol=1e-5)   # min_advantage 0
    assert run["loss_by_hand"] < -1e-3 and abs(run["loss_by_hand"] - run["loss_with_grpo"]) > 1e-3, run
    assert run["loss"] == pytest.approx(run["loss_by_hand"], abs=1e-6), run


def test_iterations_of_the_loop_run(run):
    h = run["history"]
    assert len(h["reward"]) == 2 and run["weights_changed"]
    for key in ("reward", "kl", "clip_frac", "entropy", "rollout_s", "train_s"):
        assert all(math.isfinite(x) for x in h[key]), key
