"""rl.core by hand: the loss reductions, the reward's solved convention, batches of groups, the
training batch layout, prompt draws; the HF backend against the RolloutBackend Protocol."""
import pytest
import torch

from mfsdp_kit import data
from mfsdp_kit.rl import core
from mfsdp_kit.rl.rollout import HFRollout, RolloutBackend


def test_aggregate_token_level_and_sequence_mean_by_hand():
    per_token = torch.tensor([[2., 9., 9.], [1., 3., 5.], [7., 7., 7.]])
    mask = torch.tensor([[1., 0., 0.], [1., 1., 1.], [0., 0., 0.]])  # lengths 1, 3, 0
    s, c = core.aggregate(per_token, mask, level="token")
    assert (s.item(), c.item()) == (11.0, 4.0)  # (2 + 1 + 3 + 5) / 4 tokens
    s, c = core.aggregate(per_token, mask, level="sequence")
    assert (s.item(), c.item()) == (5.0, 2.0)  # (2 / 1 + 9 / 3) / 2 sequences; the empty one counts nowhere
    with pytest.raises(ValueError, match="'token' | 'sequence'"):
        core.aggregate(per_token, mask, level="batch")


def test_reward_says_what_counts_as_solved():
    prompt, answer = data.ArithmeticTask(digits=1).rl_prompts(1)[0]
    exact = core.as_reward(data.verify)
    assert exact(prompt, answer) == 1.0 and exact.solved_threshold == 1.0
    assert exact.solved(torch.tensor([1.0, 0.5, 0.0])).tolist() == [True, False, False]
    lenient = core.Reward(fn=data.digit_match, solved_threshold=0.5)
    assert core.as_reward(lenient) is lenient
    assert lenient.solved(torch.tensor([1.0, 0.5, 0.25])).tolist() == [True, True, False]


def _groups(names, rewards):
    r = torch.tensor(rewards, dtype=torch.float)
    return core.RolloutBatch(prompts=[(n, "") for n in names], prompt_ids=[[i] for i in range(len(names))],
                             completions=[[int(x)] for x in range(len(r))], rewards=r, solved=r >= 1,
                             group_size=2, stats={"rollout_s": 1.0})


def test_select_and_concat_keep_groups_together():
    a, b = _groups("ab", [1, 0, 1, 1]), _groups("c", [0, 1])
    both = core.concat([a, b])
    assert both.num_groups == 3 and both.rewards.tolist() == [1, 0, 1, 1, 0, 1] and both.stats == {"rollout_s": 2.0}
    picked = both.select_groups([2, 0])
    assert [p for p, _ in picked.prompts] == ["c", "a"] and picked.rewards.tolist() == [0, 1, 1, 0]
    assert picked.completions == [[0], [1], [0], [1]] and picked.solved.tolist() == [False, True, True, False]


def test_rollout_batch_puts_the_loss_on_completion_tokens():
    batch = core.rollout_batch([[5, 6, 7]], [[8, 9]], torch.tensor([0.5]), seq_len_tokens=6, pad_id=0)
    assert batch.tokens.tolist() == [[5, 6, 7, 8, 0, 0]] and batch.labels.tolist() == [[6, 7, 8, 9, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0, 0]]  # predicting 8 and 9
    assert batch.extras["advantages"].tolist() == [0.5]


def test_prompt_draw_repeats_grpos_picks():
    pool = [(str(i), "") for i in range(20)]
    draw, rng = core.PromptDraw(pool, seed=3), torch.Generator().manual_seed(3)
    for k in (4, 4, 6):
        assert draw(k) == [pool[i] for i in torch.randperm(20, generator=rng)[:k].tolist()]


def test_group_advantages_are_zero_for_a_flat_group():
    adv = core.group_advantages(torch.tensor([3.0, 3.0, 0.0, 2.0]), group_size=2)
    assert torch.allclose(adv, torch.tensor([0.0, 0.0, -1.0, 1.0]), atol=1e-5)


def test_hf_rollout_is_a_backend_and_samples_reproducibly(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mfsdp_kit.models.tiny import tiny
    src = tiny(tmp_path / "xs", size="xs", seed=0)
    rollout = HFRollout(AutoModelForCausalLM.from_pretrained(src), AutoTokenizer.from_pretrained(src))
    assert isinstance(rollout, RolloutBackend)
    prompts = [p for p, _ in data.ArithmeticTask(digits=1).rl_prompts(3)]
    kw = dict(n=2, max_new_tokens=5, temperature=1.0, top_p=1.0)
    first = rollout.sample(prompts, seed=7, **kw)
    assert len(first) == 6 and first == rollout.sample(prompts, seed=7, **kw)
    eos = rollout.tokenizer.eos_token_id
    assert all(len(c) <= 5 and (eos not in c or c.index(eos) == len(c) - 1) for c in first)  # cut after eos
