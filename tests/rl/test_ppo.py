"""PPO (rl.ppo, rl.critic): the clipped value loss by hand, the policy loss on per-token advantages, and on 2 gloo
ranks a value model sharded by Megatron-FSDP with its own optimizer, and PPO iterations whose critic loss falls."""
import math

import pytest
import torch

from mfsdp_kit.config import ConfigError
from mfsdp_kit.rl import critic, grpo, ppo
from mfsdp_kit.train import Batch
from tests.dist import launch


def critic_mb(old, ret):
    mask = torch.ones(1, len(old))
    return Batch(torch.zeros(1, len(old), dtype=torch.long), torch.zeros(1, len(old), dtype=torch.long), mask,
                 dict(values=torch.tensor([old]), returns=torch.tensor([ret])))


def test_the_value_loss_is_clipped_around_the_old_values():
    # token 0: V moved +0.3 from V_old 0 toward R 1 with clip 0.2 -> V_clip 0.2: max((0.7)^2, (0.8)^2) = 0.64
    # token 1: V moved -0.1, inside the clip: (V - R)^2 = (0.9 - 1)^2 = 0.01
    # token 2: V moved +0.5 past R (0.5 -> 1.0, R 0.8): V_clip 0.7, max(0.04, 0.01) = 0.04 (the unclipped one)
    mb = critic_mb([0.0, 1.0, 0.5], [1.0, 1.0, 0.8])
    v = torch.tensor([[0.3, 0.9, 1.0]], requires_grad=True)
    loss, count, logged = critic.value_loss(mb, v, value_clip=0.2)
    assert int(count) == 3 and math.isclose(loss.item(), 0.5 * (0.64 + 0.01 + 0.04), abs_tol=1e-6)
    assert math.isclose(logged["value_clip_frac"][0].item(), 2.0)            # tokens 0 and 2 left the range
    loss.backward()
    assert v.grad[0, 0] == 0 and v.grad[0, 2] > 0 and v.grad[0, 1] < 0      # the clipped term carries no gradient
    plain, _, _ = critic.value_loss(mb, v.detach(), value_clip=None)
    assert math.isclose(plain.item(), 0.5 * (0.49 + 0.01 + 0.04), abs_tol=1e-6)


def test_explained_variance():
    mask = torch.tensor([[1, 1, 1, 0.0]])
    ret = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    assert math.isclose(critic.explained_variance(ret, ret, mask), 1.0)
    assert math.isclose(critic.explained_variance(torch.full((1, 4), 2.0), ret, mask), 0.0, abs_tol=1e-6)
    assert math.isnan(critic.explained_variance(ret, torch.ones(1, 4), mask))


def test_the_policy_loss_reads_per_token_advantages():
    """[n, seq] advantages equal per token to an [n] one give the same loss; differing ones weigh each token."""
    logp = torch.log(torch.tensor([[1.0, 1.1, 0.9]]))
    zeros = torch.zeros(1, 3)

    def loss(adv):
        mb = Batch(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3),
                   dict(old_logprobs=zeros, ref_logprobs=zeros, advantages=adv))
        return grpo.grpo_loss(mb, -logp, clip_eps=0.2, kl_coef=0.0)[0].item()
    assert math.isclose(loss(torch.tensor([2.0])), loss(torch.full((1, 3), 2.0)), abs_tol=1e-6)
    assert math.isclose(loss(torch.tensor([[1.0, 0.0, -1.0]])), -(1.0 - 0.9), abs_tol=1e-6)


def test_the_config_checks_gae_fields():
    with pytest.raises(ConfigError, match="lam=1.5"):
        ppo.PPOConfig(lam=1.5)
    with pytest.raises(ConfigError, match="value_clip=0"):
        ppo.PPOConfig(value_clip=0)
    assert ppo.PPOConfig(value_clip=None).value_clip is None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return launch.run("scenarios_ppo:ppo_end_to_end", workdir=str(tmp_path_factory.mktemp("ppo")), iterations=6)


def test_the_value_model_is_sharded_by_megatron_fsdp(run):
    s = run["sharding"]
    print(s)
    assert s["wrapper"] == "FullyShardedDataParallel"
    assert s["head_shape"] == [1, s["hidden_size"]] and s["values_shape"] == [16, 16]
    assert sum(s["local_numel"]) == s["global_numel"] and max(s["local_numel"]) < s["global_numel"]
    assert s["all_dtensors"] and s["vocab_head_gone"]


def test_the_critic_and_the_policy_have_separate_optimizers(run):
    s = run["separate"]
    assert s["shared_params"] == 0 and s["critic_params"] > 0 and s["policy_params"] > 0
    assert s["policy_unchanged_by_critic_step"] and s["critic_changed"]
    policy_steps, critic_steps = s["policy_state_steps_before_after"], s["critic_state_steps_before_after"]
    assert policy_steps[0] == policy_steps[1] > 0 and critic_steps[1] > critic_steps[0] > 0, s


def test_ppo_iterations_run_and_the_critic_loss_falls(run):
    h = run["history"]
    print({k: [round(x, 4) for x in v] for k, v in h.items() if k.startswith(("value", "expl", "reward", "adv"))})
    assert len(h["value_loss"]) == 6
    for key in ("reward", "kl", "clip_frac", "value_loss", "value_clip_frac", "value_mean", "critic_s", "train_s"):
        assert all(math.isfinite(x) for x in h[key]), key
    assert h["value_loss"][-1] < h["value_loss"][0], h["value_loss"]          # 0.089 -> 0.044 when written
    # the zero head: V = 0 at first; later the values explain part of the returns' variance
    assert h["value_mean"][0] == 0.0 and h["explained_variance"][0] == 0.0
    assert h["value_mean"][-1] > 0.0 and h["explained_variance"][-1] > 0.0
    assert run["policy_weights_changed"]


def test_the_critic_runs_packed_rows_as_padded_ones(run):
    """The critic (SDPA attention) took packed rows in the fit; its values from packed rows equal padded ones."""
    r = run["packed_vs_padded_values"]
    assert r["can_pack"] and r["values_abs_mean"] > 0 and r["max_diff"] < 1e-5, r


def test_one_step_iterations_take_pi_old_from_the_update(run):
    """ppo_epochs x num_minibatches == 1: rl.on_policy's path (ratio exactly 1) with GAE's [n, seq] advantages."""
    h = run["one_step_history"]
    assert h["clip_frac"] == [0.0] and math.isfinite(h["value_loss"][0]) and math.isfinite(h["entropy"][0]), h


def test_the_critic_checkpoint_round_trips(run):
    """CheckpointManager saves the critic like any chunks; a fresh critic (V = 0) that loads it gives its values."""
    r = run["checkpoint"]
    assert r["saved_abs_max"] > 1e-3 and r["after"] == 0.0, r
