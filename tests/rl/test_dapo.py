"""DAPO: the group filter and refill, the token-level loss and clip-higher by hand, and two
iterations on 2 gloo ranks (with megatron's loss reduction compared to the one-process formula)."""
import math

import pytest
import torch

from mfsdp_kit.rl import core, dapo, grpo
from mfsdp_kit.train import Batch
from tests.dist import launch

FOUR_GROUPS = torch.tensor([1., 0., 0., 1.,    # informative
                            1., 1., 1., 1.,    # all solved: A = 0
                            0., 0., 0., 0.,    # all failed: A = 0
                            0., 1., 0., 0.])   # informative


def _rollouts(rewards: list[list[float]], names: list[str]) -> core.RolloutBatch:
    """A scored batch of len(names) groups of 4 (completions are placeholders: the filter reads rewards)."""
    r = torch.tensor(rewards).flatten()
    return core.RolloutBatch(prompts=[(n, "") for n in names], prompt_ids=[[0] for _ in names],
                             completions=[[1]] * len(r), rewards=r, solved=r >= 1.0, group_size=4)


def test_filter_keeps_the_two_informative_groups_and_refill_asks_for_two_more():
    assert dapo.informative_groups(FOUR_GROUPS, group_size=4) == [0, 3]
    assert dapo.prompts_to_draw(wanted_groups=4, kept_groups=2, multiple_of=2) == 2
    assert dapo.prompts_to_draw(wanted_groups=4, kept_groups=2, multiple_of=4) == 4  # every dp rank samples
    assert dapo.prompts_to_draw(wanted_groups=4, kept_groups=3, multiple_of=2) == 2
    assert dapo.prompts_to_draw(wanted_groups=4, kept_groups=5, multiple_of=2) == 0


def test_dynamic_sample_refills_until_the_batch_is_full():
    script = [[[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0]],   # round 0: keeps a, d
              [[1, 1, 1, 1], [0, 1, 1, 1]],                               # round 1: keeps f
              [[0, 1, 0, 1], [1, 0, 0, 0]]]                               # round 2: keeps g, h
    names = [list("abcd"), list("ef"), list("gh")]
    asked = []

    def sample_round(r, k):
        asked.append(k)
        return _rollouts(script[r], names[r])

    kept, sampled, rounds = dapo.dynamic_sample(sample_round=sample_round, wanted_groups=4, max_rounds=5,
                                                multiple_of=2)
    assert asked == [4, 2, 2] and rounds == 3 and sampled.num_groups == 8
    assert [p for p, _ in kept.prompts] == ["a", "d", "f", "g"]  # 5 informative, trimmed to the 4 wanted
    assert kept.rewards.tolist() == [1, 0, 0, 1, 0, 1, 0, 0, 0, 1, 1, 1, 0, 1, 0, 1]

    asked.clear()
    kept, _, rounds = dapo.dynamic_sample(sample_round=sample_round, wanted_groups=4, max_rounds=2, multiple_of=2)
    assert asked == [4, 2] and rounds == 2 and [p for p, _ in kept.prompts] == ["a", "d", "f"]
    with pytest.raises(ValueError, match="max_sampling_rounds=0"):
        dapo.dynamic_sample(sample_round=sample_round, wanted_groups=4, max_rounds=0, multiple_of=2)


def test_usable_groups_fit_the_minibatch_split():
    # 2 ranks x 1 minibatch x micro-batch 4 = sequences in multiples of 8 = 2 groups of 4
    assert [dapo.usable_groups(g, group_size=4, sequences_multiple_of=8) for g in range(6)] == [0, 0, 2, 2, 4, 4]
    assert dapo.usable_groups(9, group_size=3, sequences_multiple_of=8) == 8  # lcm(3, 8) = 24 sequences


def _hand_batch():
    """Two sequences: A = +1 with 1 loss token (ratio 1.25), A = -0.5 with 3 (ratios 1, 1, 0.75).
    Position 1-2 of sequence 0 are padding (mask 0) with a ratio that must not count."""
    ratio = torch.tensor([[1.25, 3.0, 3.0], [1.0, 1.0, 0.75]])
    logp = ratio.log().requires_grad_()
    old = torch.zeros(2, 3)
    mb = Batch(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long),
               torch.tensor([[1., 0., 0.], [1., 1., 1.]]),
               dict(old_logprobs=old, ref_logprobs=old.clone(), advantages=torch.tensor([1.0, -0.5])))
    return mb, logp


def test_token_level_loss_by_hand_differs_from_the_sequence_mean():
    # per token l = -min(rho A, clip(rho, 0.8, 1.28) A):
    #   seq 0: -min(1.25, 1.25) = -1.25                       (1.25 < 1.28: clip-higher lets it through)
    #   seq 1: -min(-0.5, -0.5) = 0.5, 0.5; -min(-0.375, -0.4) = 0.4   (0.75 < 0.8: clipped)
    # token level:    (-1.25 + 0.5 + 0.5 + 0.4) / 4         =  0.0375
    # sequence mean:  (-1.25 / 1 + 1.4 / 3) / 2            = -0.391666...
    mb, logp = _hand_batch()
    loss_sum, count, logged = dapo.dapo_loss(mb, -logp, eps_low=0.2, eps_high=0.28)
    assert int(count) == 4 and loss_sum.item() == pytest.approx(0.15, abs=1e-6)
    assert (loss_sum / count).item() == pytest.approx(0.0375, abs=1e-6)
    seq_sum, seq_count, _ = grpo.policy_loss(mb, -logp, eps_low=0.2, eps_high=0.28, kl_coef=0.0, level="sequence")
    assert int(seq_count) == 2 and (seq_sum / seq_count).item() == pytest.approx(-0.391667, abs=1e-6)
    assert logged["clip_frac"].tolist() == [1.0, 4.0]  # only the 0.75 token is clipped

    # gradient per token (what megatron applies: d(loss_sum)/d logp / count): the token level gives
    # each of sequence 1's unclipped tokens -rho A / 4 = 0.125; the sequence mean 0.5 / 3 / 2 = 0.0833
    (loss_sum / count).backward()
    assert logp.grad[1, 0].item() == pytest.approx(0.125) and logp.grad[1, 2].item() == 0.0
    assert logp.grad[0, 0].item() == pytest.approx(-1.25 / 4) and logp.grad[0, 1:].abs().sum() == 0
    mb, logp = _hand_batch()
    seq_sum, seq_count, _ = grpo.policy_loss(mb, -logp, eps_low=0.2, eps_high=0.28, kl_coef=0.0, level="sequence")
    (seq_sum / seq_count).backward()
    assert logp.grad[1, 0].item() == pytest.approx(0.5 / 3 / 2)


def test_clip_higher_lets_a_rising_token_further_than_grpo():
    # GRPO's symmetric clip 0.2 caps seq 0's ratio at 1.2: (-1.2 + 1.4) / 4 = 0.05, and that token gets no gradient
    mb, logp = _hand_batch()
    loss_sum, count, _ = grpo.grpo_loss(mb, -logp, clip_eps=0.2, kl_coef=0.0)
    assert (loss_sum / count).item() == pytest.approx(0.05, abs=1e-6)
    loss_sum.backward()
    assert logp.grad[0, 0].item() == 0.0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return launch.run("scenarios_rl:dapo_end_to_end", workdir=str(tmp_path_factory.mktemp("dapo")), iterations=2)


def test_megatron_reduction_over_ranks_equals_the_one_process_formula(run):
    # before any update ratio = 1, so l_it = -A_i: token level -sum_i A_i |o_i| / sum_i |o_i|, and the
    # sequence mean -mean_i A_i = 0 (advantages sum to zero in every group)
    print("token level (megatron, by hand):", run["token_level"], "sequence mean:", run["sequence_level"])
    assert run["token_level"][0] == pytest.approx(run["token_level"][1], abs=1e-5)
    assert run["sequence_level"][0] == pytest.approx(run["sequence_level"][1], abs=1e-5)
    assert abs(run["sequence_level"][1]) < 1e-5 and abs(run["token_level"][1]) > 1e-4  # 2.6e-3 here


def test_dynamic_sampling_on_real_rollouts_keeps_only_informative_groups(run):
    ds = run["dynamic_sample"]
    print(ds)
    assert ds["asked"][0] == 8 and all(k % 2 == 0 for k in ds["asked"]) and ds["sampled_groups"] == sum(ds["asked"])
    assert ds["kept_groups"] <= 8 and all(s > 0 for s in ds["kept_group_std"])
    assert ds["kept_groups"] == 8 or len(ds["asked"]) == 4  # full, or out of rounds
    assert ds["informative_in_round_0"] < 8 and len(ds["asked"]) > 1  # flat groups were dropped and refilled


def test_dapo_iterations_run_end_to_end(run):
    h = run["history"]
    print({k: [round(x, 4) for x in v] for k, v in h.items()})
    assert len(h["reward"]) == 2 and all(b > 0 for b in h["sync_bytes"])
    assert all(0 < k <= 8 for k in h["groups_kept"]) and all(k % 2 == 0 for k in h["groups_kept"])
    assert all(s >= k for s, k in zip(h["groups_sampled"], h["groups_kept"]))
    for key in ("reward", "accuracy", "kl", "clip_frac", "entropy", "rollout_s", "train_s"):
        assert all(math.isfinite(x) for x in h[key]), key
    assert run["weights_changed"]
