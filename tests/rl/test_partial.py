"""rl.partial: the pool's staleness drop, its size, the trained batch's layout and staleness, the refusals (here);
on 2 gloo ranks (tests/dist/scenarios_partial.py): partial_fraction 1 samples what the synchronous loop samples,
versions and the staleness bound over iterations, GRPO with partial rollouts through `loop.fit`."""
import math

import pytest
import torch

from mfsdp_kit.config import ConfigError
from mfsdp_kit.rl import core, loop, partial
from mfsdp_kit.rl.algorithms import DAPOConfig, GRPOConfig
from mfsdp_kit.rl.rollout import HFRollout
from tests.dist import launch


def pool_of(rows_versions: list[list[list[int]]]) -> partial.Pool:
    return partial.Pool(groups=[partial.Group(prompt=("p", "a"), prompt_ids=[1], rows=[
        partial.Row(tokens=[5] * len(v), logprobs=[-1.0] * len(v), versions=list(v), ended=len(v) == 3)
        for v in group]) for group in rows_versions])


def test_rows_older_than_max_staleness_start_again():
    pool = pool_of([[[2, 3, 3], [3], []], [[1, 3], [3, 3, 3], [2]]])
    assert pool.drop_stale(version=4, max_staleness=1) == 3   # the rows holding a token of version 2 or 1
    assert [[r.versions for r in g.rows] for g in pool.groups] == [[[], [3], []], [[], [3, 3, 3], []]]
    assert all(not r.ended and not r.tokens and not r.logprobs for r in pool.groups[0].rows[::2])
    assert pool.drop_stale(version=4, max_staleness=1) == 0 and pool.drop_stale(version=5, max_staleness=2) == 0


def test_pool_size_is_prompts_over_the_fraction_in_whole_replicas():
    cfg = GRPOConfig(prompts_per_iteration=8, partial_fraction=0.75)
    assert partial.pool_size(cfg, dp=1) == 11 and partial.pool_size(cfg, dp=2) == 12
    assert partial.pool_size(GRPOConfig(prompts_per_iteration=8, partial_fraction=1.0), dp=4) == 8


def test_trained_batch_keeps_each_tokens_logprob_and_version():
    pool = pool_of([[[2, 3, 3], [3, 3, 3]], [[3, 3, 3], [1, 2, 3]]])
    for g, rewards in zip(pool.groups, ([1.0, 0.0], [0.0, 0.0])):
        for r, x in zip(g.rows, rewards):
            r.reward = x
    batch = partial.rollout_batch(pool.groups, reward=core.as_reward(lambda p, c: 0.0), stats={})
    assert batch.group_size == 2 and batch.versions == [[2, 3, 3], [3, 3, 3], [3, 3, 3], [1, 2, 3]]
    assert batch.solved.tolist() == [True, False, False, False] and len(batch.logprobs[3]) == 3
    lag = partial.staleness(batch, version=3)
    assert lag["staleness_max"] == 2 and math.isclose(lag["staleness_mean"], 4 / 12)
    assert math.isclose(lag["off_policy_token_frac"], 3 / 12) and lag["staleness_tokens"] == [9, 2, 1]


def test_what_partial_rollouts_cannot_continue_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="partial_fraction=0 "):
        GRPOConfig(partial_fraction=0)
    with pytest.raises(ConfigError, match="max_staleness"):
        GRPOConfig(partial_fraction=0.5, max_staleness=-1)
    with pytest.raises(ConfigError, match="router_replay"):
        GRPOConfig(partial_fraction=0.5, router_replay=True)
    models = loop.Models(chunks=[], optimizer=None, bridge=None, rollout=HFRollout.__new__(HFRollout))
    with pytest.raises(ConfigError, match="dapo"):
        partial.check(models, DAPOConfig(partial_fraction=0.5))
    with pytest.raises(ConfigError, match="ContinuousRollout"):
        partial.check(models, GRPOConfig(partial_fraction=0.5))
    with pytest.raises(ConfigError, match="pool=None"):
        loop.iteration(models=models, cfg=GRPOConfig(partial_fraction=0.5), draw=None, reward_fn=None,
                       seq_len_tokens=8)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return launch.run("scenarios_partial:partial_rollouts", workdir=str(tmp_path_factory.mktemp("partial")))


def test_partial_fraction_one_samples_what_the_synchronous_loop_samples(run):
    p = run["parity"]
    assert p["same_completions"] and p["same_logprobs"] and p["same_rewards"] and p["same_prompts"]
    assert p["versions"] == [3] and p["metrics"]["rows_carried"] == 0 and p["metrics"]["staleness_max"] == 0


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_versions_are_right_and_staleness_is_bounded(run, max_staleness):
    its = run[f"stale{max_staleness}"]["iterations"]
    for it, m in enumerate(its):
        assert m["groups"] == 4 and m["rows"] == 16   # every iteration trains prompts_per_iteration groups
        assert all(len(v) == n for v, n in zip(m["versions"], m["ended"]))
        for v in m["versions"] + m["pool_versions"]:
            assert v == sorted(v) and all(it - max_staleness <= x <= it for x in v), (it, v)
        assert m["metrics"]["staleness_max"] <= max_staleness and m["pool_groups"] == 4
    resumed = sum(m["metrics"]["rows_resumed"] for m in its)   # rows continued across iterations: none at 0,
    dropped = sum(m["metrics"]["stale_rows_dropped"] for m in its)   # where every carried row is dropped instead
    assert (resumed > 0) if max_staleness else (resumed == 0 and dropped > 0), (resumed, dropped)
    assert any(m["metrics"]["staleness_max"] == 1 for m in its) == (max_staleness == 1)


def test_grpo_with_partial_rollouts_trains_end_to_end(run):
    h = run["history"]
    print({k: [x if isinstance(x, list) else round(x, 4) for x in v] for k, v in h.items()})
    assert len(h["reward"]) == 4 and h["groups_kept"] == [4] * 4
    for key in ("reward", "kl", "clip_frac", "rollout_s", "train_s", "is_weight_mean", "staleness_mean"):
        assert all(math.isfinite(x) for x in h[key]), key
    assert max(h["staleness_max"]) <= 1 and h["rows_carried"][0] > 0
    assert [len(c) - 1 for c in h["staleness_tokens"]] == h["staleness_max"]


def test_carried_groups_are_dealt_round_robin_and_come_back_in_pool_order():
    dealt = partial.dealing(8, carried=3, dp=2)
    assert dealt == [0, 2, 3, 4, 1, 5, 6, 7]   # replica 0: carried 0 and 2, new 3 and 4; replica 1: carried 1
    back = [f"g{i}" for i in dealt]   # what the gather returns, replica by replica
    assert [back[dealt.index(i)] for i in range(8)] == [f"g{i}" for i in range(8)]
    assert partial.dealing(8, carried=0, dp=2) == list(range(8))   # none carried: the synchronous loop's split
