"""rl.decoupled: the schedule and the staleness filter by hand; refusals before any work; and on two worlds
(tests/dist/scenarios_decoupled.py: 1 trainer + 1 rollout process over a push.Link) the synchronous loop's samples
and updates at max_staleness 0, versions k - 1 at max_staleness 1."""
import math

import pytest
import torch

from mfsdp_kit.config import ConfigError
from mfsdp_kit.rl import core, decoupled
from mfsdp_kit.rl.algorithms.dapo import DAPOConfig
from mfsdp_kit.rl.algorithms.grpo import GRPOConfig


def _batch(versions: list[int], *, group_size: int = 2) -> core.RolloutBatch:
    n = len(versions)
    return core.RolloutBatch(prompts=[(f"p{g}", "a") for g in range(n // group_size)],
                             prompt_ids=[[g] for g in range(n // group_size)], completions=[[1, 2]] * n,
                             rewards=torch.arange(n).float(), solved=torch.zeros(n, dtype=torch.bool),
                             group_size=group_size, versions=[[v, v + 1] for v in versions])


def test_schedule_lags_by_the_bound():
    assert [decoupled.needed(j, 0) for j in range(4)] == [0, 1, 2, 3]
    assert [decoupled.needed(j, 1) for j in range(4)] == [0, 0, 1, 2]
    assert [decoupled.needed(j, 3) for j in range(5)] == [0, 0, 0, 0, 1]


def test_fresh_drops_whole_groups_past_the_bound():
    batch = _batch([5, 5, 3, 5, 4, 4])   # group 1 holds a row whose oldest token is version 3
    kept, dropped = decoupled.fresh(batch, version=5, max_staleness=1)
    assert dropped == 1 and kept.prompts == [("p0", "a"), ("p2", "a")]
    assert kept.rewards.tolist() == [0.0, 1.0, 4.0, 5.0] and kept.versions == [[5, 6], [5, 6], [4, 5], [4, 5]]
    same, none = decoupled.fresh(batch, version=5, max_staleness=2)
    assert none == 0 and same is batch
    assert decoupled.staleness(batch, version=5) == dict(staleness_max=2, staleness_mean=pytest.approx(4 / 6))
    batch.versions = None   # a batch no decoupled rollout made
    with pytest.raises(ValueError, match="RolloutBatch.versions=None"):
        decoupled.fresh(batch, version=5, max_staleness=1)


def test_refuses_what_it_cannot_run_before_any_work():
    with pytest.raises(ConfigError, match="DAPOConfig.*samples once per iteration"):
        decoupled.fit(models=None, cfg=DAPOConfig(), link=None, tokenizer=None, prompt_pool=[], iterations=1)
    with pytest.raises(ValueError, match="offload_during_rollout=True"):
        decoupled.fit(models=None, cfg=GRPOConfig(offload_during_rollout=True), link=None, tokenizer=None,
                      prompt_pool=[], iterations=1)
    with pytest.raises(ValueError, match="max_staleness"):
        decoupled.fit(models=None, cfg=GRPOConfig(), link=None, tokenizer=None, prompt_pool=[], iterations=1,
                      max_staleness=-1)


def test_two_worlds_match_the_synchronous_loop_and_lag_one_version(tmp_path):
    from mfsdp_kit.models.tiny import tiny
    from tests.dist import launch
    from tests.dist.scenarios_decoupled import ITERATIONS
    src = str(tiny(tmp_path / "xs", size="xs", seed=0))
    r = launch.run("scenarios_decoupled:two_worlds", src=src, world_port=launch.free_port(),
                   link_ports=[launch.free_port(), launch.free_port()])
    sync, s0, s1 = r["sync"], r["staleness0"], r["staleness1"]
    # staleness 0: the synchronous loop through the link, sample for sample, update for update
    assert s0["samples"] == sync["samples"] and len(sync["samples"]) == ITERATIONS
    for key in ("reward", "loss", "kl", "entropy", "response_tokens"):
        assert s0[key] == sync[key], (key, s0[key], sync[key])
    assert s0["weights"] == sync["weights"] != s1["weights"]   # the same three updates
    assert len(set(sync["reward"])) > 1 and all(math.isfinite(x) for x in s0["loss"])
    assert s0["versions"] == s0["policy_version"] == [0, 1, 2] and s0["staleness_max"] == [0, 0, 0]
    # staleness 1: iteration k samples with version k - 1 (0 for the first two), within the bound
    assert s1["versions"] == [0, 0, 1] and s1["policy_version"] == [0, 1, 2]
    assert s1["staleness_max"] == [0, 1, 1] and s1["groups_stale"] == [0, 0, 0]
    assert s1["samples"][0] == sync["samples"][0]
    assert all(math.isfinite(x) for x in s1["loss"])
    assert s1["is_weight_mean"][0] == 1.0 != s1["is_weight_mean"][1]   # pi_old (version 1) over q (version 0)


def test_a_trainer_world_of_two_shares_the_samples(tmp_path):
    from mfsdp_kit.models.tiny import tiny
    from tests.dist import launch
    src = str(tiny(tmp_path / "xs", size="xs", seed=0))
    r = launch.run("scenarios_decoupled:trainer_world_of_two", nproc=3, src=src, world_port=launch.free_port(),
                   link_port=launch.free_port())
    assert r["versions"] == [0, 0, 1] and r["policy_version"] == [0, 1, 2] and r["staleness_max"] == [0, 1, 1]
    assert r["weights_agree"] and len(r["samples"]) == 3 and len(set(r["reward"])) > 1


def test_serve_refuses_router_replay_on_a_backend_without_routes(tmp_path):
    import pickle

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from mfsdp_kit.models.tiny import tiny
    from mfsdp_kit.rl.rollout import HFRollout
    from mfsdp_kit.weights import push
    src = tiny(tmp_path / "xs", size="xs", seed=0)
    store = dist.HashStore()   # the plan is read before the link's group is used
    store.set(decoupled.PLAN_KEY, pickle.dumps(dict(cfg=GRPOConfig(router_replay=True), iterations=1,
                                                    max_staleness=0)))
    link = push.Link(group=None, rank=1, size=2, device=torch.device("cpu"), store=store)
    backend = HFRollout(AutoModelForCausalLM.from_pretrained(src), AutoTokenizer.from_pretrained(src))
    with pytest.raises(ValueError, match="router_replay=True.*ContinuousRollout"):
        decoupled.serve(link=link, backend=backend, prompt_pool=[("1+1=", "2")], reward_fn=lambda p, c: 0.0)
