"""GRPO: advantages, clipping, update direction, sync parity and an end-to-end run on 2 ranks."""
import math

import pytest
import torch

from mfsdp_kit.rl import grpo
from mfsdp_kit.train import Batch
from tests.dist import launch


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # groups of 4
    adv = grpo.group_advantages(rewards, group_size=4)
    # group 1: mean 0.5, population std 0.5 -> +-1; group 2: all equal -> 0 (eps keeps it finite)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0, 0, 0, 0, 0]), atol=1e-5)


def _mb(ratio: float, adv: float):
    old = torch.zeros(1, 3)
    logp = torch.full((1, 3), math.log(ratio), requires_grad=True)
    mb = Batch(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3),
               dict(old_logprobs=old, ref_logprobs=old.clone(), advantages=torch.tensor([adv])))
    return mb, logp


@pytest.mark.parametrize("ratio,adv,clipped", [(1.5, 1.0, True), (1.1, 1.0, False), (0.5, -1.0, True),
                                               (0.5, 1.0, False)])
def test_clipping_beyond_the_ratio_bound(ratio, adv, clipped):
    mb, logp = _mb(ratio, adv)
    loss, count, logged = grpo.grpo_loss(mb, -logp, clip_eps=0.2, kl_coef=0.0)
    loss.backward()
    assert int(count) == 3
    assert (logp.grad.abs().sum().item() == 0.0) == clipped  # clipped tokens get no gradient
    assert logged["clip_frac"][0].item() == (3.0 if abs(ratio - 1) > 0.2 else 0.0)


def test_positive_advantage_gradient_raises_logp():
    mb, logp = _mb(1.0, 2.0)
    loss, _, _ = grpo.grpo_loss(mb, -logp, clip_eps=0.2, kl_coef=0.0)
    loss.backward()
    assert (logp.grad < 0).all()  # descending the loss increases log p


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return launch.run("scenarios_rl:grpo_end_to_end", workdir=str(tmp_path_factory.mktemp("rl")), iterations=3)


def test_rollout_weights_equal_export_after_sync(run):
    assert run["sync_tensors"] == 27 and run["weights_maxdiff"] == 0.0


def test_rollout_logits_equal_megatron_logits(run):
    print("rollout vs Megatron logits max|diff|", run["logits_maxdiff"])
    assert run["logits_maxdiff"] < 1e-5


def test_positive_advantages_raise_sampled_logprobs(run):
    assert run["first_step_clip_frac"] == 0.0 and abs(run["first_step_kl"]) < 1e-6  # old == current
    before, after = run["logp_sum_before_after"]
    print("sum log p of sampled tokens before/after one step:", before, after)
    assert after > before


def test_iterations_run_end_to_end(run):
    h = run["history"]
    print({k: [round(x, 4) for x in v] for k, v in h.items()})
    assert len(h["reward"]) == 3
    for key in ("reward", "kl", "clip_frac", "entropy", "sync_s", "rollout_s", "train_s", "response_tokens"):
        assert all(math.isfinite(x) for x in h[key]), key
    assert all(0.0 <= r <= 1.0 for r in h["reward"]) and all(b > 0 for b in h["sync_bytes"])
    assert all(k >= 0.0 for k in h["kl"])


def test_an_iteration_runs_through_the_continuous_backend(run):
    """rl.rollout.ContinuousRollout in the GRPO loop: refreshed from the Megatron-FSDP chunks (HFRollout's
    refresh, in place), sampled by the kit's engine, trained on."""
    h = run["continuous_history"]
    assert len(h["reward"]) == 1 and h["sync_bytes"][0] == run["history"]["sync_bytes"][0]
    for key in ("reward", "kl", "clip_frac", "rollout_s", "train_s", "response_tokens"):
        assert all(math.isfinite(x) for x in h[key]), key
    assert h["response_tokens"][0] > 0 and 0.0 <= h["reward"][0] <= 1.0


def test_a_rollout_correction_reports_its_weights_and_none_reports_nan(run):
    """The continuous iteration runs with rollout_correction="token-mask" (rl.correction): in fp32 the rollout's
    log-probs are the trainer's within roundoff, so every weight is ~1 and nothing is masked; without a
    correction the history says NaN."""
    h, plain = run["continuous_history"], run["history"]
    assert abs(h["is_weight_mean"][0] - 1) < 1e-4 and abs(h["is_weight_max"][0] - 1) < 1e-4, h
    assert h["is_changed_frac"][0] == 0.0 and abs(h["rollout_kl"][0]) < 1e-8 and abs(h["ppl_ratio"][0] - 1) < 1e-4
    assert all(math.isnan(x) for x in plain["is_weight_mean"] + plain["rollout_kl"])


def test_old_logprobs_from_the_updates_own_forward_equal_a_separate_pass(run):
    """rl.on_policy: one forward pass fewer, the same step (loss, gradient norm, clip fraction, KL), mismatch and
    correction diagnostics, reduced over both ranks' micro-batches (the planted mismatch masks some tokens)."""
    in_loss, recompute = (dict(run["on_policy"][path]) for path in ("in_loss", "recompute"))
    assert in_loss.pop("forwards") < recompute.pop("forwards")
    assert (in_loss.pop("logprob_passes"), recompute.pop("logprob_passes")) == (0, 1)
    assert 0 < in_loss["is_changed_frac"] < 1 and in_loss["logprob_diff_max"] > 0.04
    assert in_loss.keys() == recompute.keys()
    for key, value in recompute.items():
        assert in_loss[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_rollout_and_trainer_logprobs_agree_in_fp32(run):
    """The train-inference mismatch in the history (rl.scoring): the rollout backends' log-probs of their samples
    against the Megatron model's, both fp32 on CPU: <= 1e-5, for HFRollout at T 1 and ContinuousRollout at T 0.7
    (scored at 0.7 on the trainer side too; at T 1 there the gap would be the temperature's)."""
    for h in (run["history"], run["continuous_history"]):
        assert all(0.0 <= d <= 1e-5 for d in h["logprob_diff_max"]), h["logprob_diff_max"]
        assert all(0.0 <= m <= d for m, d in zip(h["logprob_diff_mean"], h["logprob_diff_max"]))


def test_tensor_parallel_ranks_sample_alike_and_score_alike():
    """GRPO at TP 2 through the kit's engine: both ranks of the replica hold the same samples (with cache row
    limits of their own, 512 and 3: they take the smaller), and the rollout's log-probs equal the vocab-parallel
    trainer's at T 0.7 (fp32)."""
    import tempfile

    from tests.dist import launch
    with tempfile.TemporaryDirectory() as workdir:
        r = launch.run("scenarios_rl:grpo_tensor_parallel", nproc=2, workdir=workdir)
    first, second = r["completions"]
    assert first == second and len(first) == 8 and r["rows"] == [3, 3]
    assert all(0.0 <= d <= 1e-5 for d in r["diff_max"]), r["diff_max"]
