"""What the critic-free estimators' tests share (RLOO, REINFORCE++): a scored batch built by hand, and the end-to-end
run on 2 gloo ranks (tests/dist/scenarios_algorithms.py) with the checks every such estimator must pass."""
import math

import pytest
import torch

from mfsdp_kit.rl import core
from tests.dist import launch


def kept(rewards: list[float], group_size: int) -> core.RolloutBatch:
    """A scored batch (prompts and completions are placeholders: the estimator reads the rewards)."""
    r = torch.tensor(rewards)
    return core.RolloutBatch(prompts=[("p", "")] * (len(r) // group_size), prompt_ids=[[0]] * (len(r) // group_size),
                             completions=[[1]] * len(r), rewards=r, solved=r >= 1, group_size=group_size)


def end_to_end(tmp_path_factory, algorithm: str) -> dict:
    """Rank 0's result of `critic_free_end_to_end` for `algorithm`."""
    return launch.run("scenarios_algorithms:critic_free_end_to_end", algorithm=algorithm,
                      workdir=str(tmp_path_factory.mktemp(algorithm.replace("+", "p"))))


def check_update(run: dict, *, name: str, expected: torch.Tensor, atol: float) -> None:
    """At one optimizer step the ratio is 1 and the loss is -sum_i A_i |o_i| / sum_i |o_i|: the estimator's
    advantages (`expected`, raised to 0: `min_advantage`) are what the iteration trained on, not GRPO's."""
    assert run["name"] == name and run["reward_of_iteration"][0] == run["reward_of_iteration"][1]
    assert torch.allclose(torch.tensor(run["advantages"]), expected.clamp(min=0), atol=atol)
    assert run["loss_by_hand"] < -1e-3 and abs(run["loss_by_hand"] - run["loss_with_grpo"]) > 1e-3, run
    assert run["loss"] == pytest.approx(run["loss_by_hand"], abs=1e-6), run


def check_iterations(run: dict) -> None:
    """Iterations of the one loop ran, finite, moving the weights, with no PPO or DAPO field filled."""
    h = run["history"]
    assert len(h["reward"]) == 2 and run["weights_changed"]
    for key in ("reward", "kl", "clip_frac", "entropy", "rollout_s", "train_s"):
        assert all(math.isfinite(x) for x in h[key]), key
    assert h["value_loss"] == [] and h["groups_kept"] == []
