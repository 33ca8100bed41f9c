"""REINFORCE++ (rl.algorithms.reinforce_pp): its advantages against batches computed by hand, its config's one
estimator, and on 2 gloo ranks an iteration that trains on exactly those advantages, then iterations of the loop."""
import pytest
import torch

from mfsdp_kit.config import ConfigError
from mfsdp_kit.rl.algorithms import GRPO, GRPOConfig, REINFORCE_PP, ReinforcePPConfig, of
from tests.rl.algorithms import critic_free
from tests.rl.algorithms.critic_free import kept


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
    return critic_free.end_to_end(tmp_path_factory, "reinforce++")


def test_an_iteration_trains_on_the_batch_whitened_advantages(run):
    rewards = torch.tensor(run["rewards"])
    whitened = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
    critic_free.check_update(run, name="reinforce++", expected=whitened, atol=1e-5)


def test_iterations_of_the_loop_run(run):
    critic_free.check_iterations(run)
