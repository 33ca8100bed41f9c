"""RLOO (rl.algorithms.rloo): its advantages against a batch computed by hand, its config's one estimator, and on 2
gloo ranks an iteration that trains on exactly those advantages, then iterations of the one loop."""
import pytest
import torch

from mfsdp_kit.config import ConfigError
from mfsdp_kit.rl.algorithms import GRPO, GRPOConfig, RLOO, RLOOConfig, of
from tests.rl.algorithms import critic_free
from tests.rl.algorithms.critic_free import kept

REWARDS = [1.0, 0.0, 0.0,   2.0, 2.0, 0.5]   # two groups of 3


def test_the_baseline_is_the_mean_of_the_other_samples():
    # group 1: 1 - (0 + 0) / 2, 0 - (1 + 0) / 2 twice; group 2: 2 - (2 + 0.5) / 2 twice, 0.5 - (2 + 2) / 2
    cfg = RLOOConfig(samples_per_prompt=3)
    assert of(cfg) is RLOO
    got = RLOO.advantages(kept(REWARDS, 3), cfg).advantages
    assert torch.allclose(got, torch.tensor([1.0, -0.5, -0.5, 0.75, 0.75, -1.5]), atol=1e-6)
    clamped = RLOO.advantages(kept(REWARDS, 3), RLOOConfig(samples_per_prompt=3, min_advantage=0.0)).advantages
    assert torch.allclose(clamped, torch.tensor([1.0, 0.0, 0.0, 0.75, 0.75, 0.0]), atol=1e-6)
    grpo = GRPO.advantages(kept(REWARDS, 3), GRPOConfig(samples_per_prompt=3)).advantages
    assert not torch.allclose(grpo, got, atol=1e-2)   # GRPO divides by each group's std


def test_the_config_is_leave_one_out_only():
    assert RLOOConfig().advantage_estimator == "rloo"
    with pytest.raises(ConfigError, match="advantage_estimator='grpo' is not allowed; allowed: 'rloo'"):
        RLOOConfig(advantage_estimator="grpo")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return critic_free.end_to_end(tmp_path_factory, "rloo")


def test_an_iteration_trains_on_the_leave_one_out_advantages(run):
    rewards = torch.tensor(run["rewards"]).view(-1, 4)
    others = (rewards.sum(dim=1, keepdim=True) - rewards) / 3
    critic_free.check_update(run, name="rloo", expected=(rewards - others).flatten(), atol=1e-6)


def test_iterations_of_the_loop_run(run):
    critic_free.check_iterations(run)
