"""models.router_replay on 2 gloo ranks (tests/dist/scenarios_router_replay.py): Qwen3-MoE and OLMoE, EP 1 and 2
under Megatron-FSDP, fp32. Replaying a forward's own routes changes nothing (logits and three training steps bit for
bit, the load-balancing loss included); replaying other routes dispatches exactly them."""
import math

import pytest

from tests.dist import launch

ARCHS = ["Qwen3MoeForCausalLM", "OlmoeForCausalLM"]
LAYOUTS = ["ep1-fsdp", "ep2-fsdp"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch.run("scenarios_router_replay:replay_layouts", archs=ARCHS, layouts=LAYOUTS,
                      workdir=str(tmp_path_factory.mktemp("replay")))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_replay_routes_exactly_and_changes_nothing_when_they_agree(runs, arch, layout):
    r = runs[arch][layout]
    print(arch, layout, r)
    assert r["dtype"] == "torch.int16" and r["k"] == 2 and r["layers"] >= 1
    assert r["self_replay_equal"] and r["cleared_equal"]
    assert r["dispatched_layers"] == r["layers"] and r["dispatched_as_replayed"]
    assert r["other_maxdiff"] > 1e-4 and r["flips_other"] == 1.0 and r["flips_self"] == 0.0
    assert r["train_way"] == ("packed" if layout == "ep2-fsdp" else "padded")
    assert r["replayed"] == r["plain"], (r["plain"], r["replayed"])
    assert r["shifted"]["losses"][0] != r["plain"]["losses"][0]   # the steps do replay


def test_flips_counts_expert_sets_not_order():
    import torch
    from mfsdp_kit.models.router_replay import flips
    a = torch.tensor([[[[0, 1]], [[2, 3]]]])            # [batch 1, seq 2, layers 1, k 2]
    assert flips(a, a.flip(-1)) == 0.0
    b = torch.tensor([[[[0, 1]], [[2, 0]]]])
    assert flips(a, b) == 0.5
    assert flips(a, b, mask=torch.tensor([[1, 0]])) == 0.0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rollout_dtype", ["fp32", "bf16"])
def test_rollout_routes_replayed_in_the_trainer(arch, rollout_dtype, tmp_path):
    """The kit's engine records its routes during a GRPO collect; replayed, the trainer's log-probs of the samples
    move towards the rollout's (fp32 rollout: as close as without, both fp32 roundoff; bf16 rollout: its flips are
    gone from the mismatch); then GRPO runs with `router_replay=True`."""
    r = launch.run("scenarios_router_replay:rl_replay", arch=arch, workdir=str(tmp_path), rollout_dtype=rollout_dtype)
    print(arch, rollout_dtype, r)
    assert r["shapes_ok"] and r["routes"] == r["completions"] == 8
    if rollout_dtype == "fp32":
        assert r["flips"] == 0.0 and r["diff_max_with"] < 1e-4 and r["diff_max_without"] < 1e-4
    else:
        assert r["diff_max_with"] <= r["diff_max_without"] and r["diff_mean_with"] <= r["diff_mean_without"] + 1e-6
    assert len(r["rewards"]) == 2 and all(math.isfinite(x) for x in r["kl"] + r["logprob_diff_max"])
