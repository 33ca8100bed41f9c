"""RLOO (rl.algorithms.rloo): its advantages against a batch computed by hand, its config's one estimator, and on 2
gloo ranks an iteration that trains on exactly those advantages, then iterations of the one loop."""
import math

import pytest
import torch

from mfsdp_kit.config import ConfigError
from mfsdp_kit.rl import core
from mfsdp_kit.rl.algorithms import GRPO, GRPOConfig, RLOO, RLOOConfig, of
from tests.dist import launch

REWARDS = [1.0, 0.0, 0.0,   2.0, 2.0, 0.5]   # two groups of 3


def kept(rewards: list[float], group_size: int) -> core.RolloutBatch:
    """A scored batch (prompts and completions are placeholders: the estimator reads the rewards)."""
    r = torch.tensor(rewards)
    return core.RolloutBatch(prompts=[("p", "")] * (len(r) // group_size), prompt_ids=[[0]] * (len(r) // group_size),
                             completions=[[1]] * len(r), rewards=r, solved=r >= 1, group_size=group_size)


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
    return launch.run("scenarios_algorithms:critic_free_end_to_end", workdir=str(tmp_path_factory.mktemp("rloo")),
                      algorithm="rloo")


def test_an_iteration_trains_on_the_leave_one_out_advantages(run):
    """At one optimizer step the ratio is 1 and the loss is -sum_i A_i |o_i| / sum_i |o_i|: the leave-one-out
    advantages' value (raised to 0, `min_advantage`), not GRPO's."""
    assert run["name"] == "rloo" and run["reward_of_iteration"][0] == run["reward_of_iteration"][1]
    adv, rewards = torch.tensor(run["advantages"]), torch.tensor(run["rewards"]).view(-1, 4)
    others = (rewards.sum(dim=1, keepdim=True) - rewards) / 3
    assert torch.allclose(adv, (rewards - others).flatten().clamp(min=0), atol=1e-6)   # min_advantage 0
    assert run["loss_by_hand"] < -1e-3 and abs(run["loss_by_hand"] - run["loss_with_grpo"]) > 1e-3, run
    assert run["loss"] == pytest.approx(run["loss_by_hand"], abs=1e-6), run


def test_iterations_of_the_loop_run(run):
    h = run["history"]
    assert len(h["reward"]) == 2 and run["weights_changed"]
    for key in ("reward", "kl", "clip_frac", "entropy", "rollout_s", "train_s"):
        assert all(math.isfinite(x) for x in h[key]), key
    assert h["value_loss"] == [] and h["groups_kept"] == []   # PPO's and DAPO's fields: not reported here
