"""rl.core by hand: the loss reductions, the reward's solved convention, batches of groups, the
training batch layout, prompt draws; the HF backend against the RolloutBackend Protocol."""
import pytest
import torch

from mfsdp_kit.train import data
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


def test_rollout_metrics_by_hand():
    batch = core.RolloutBatch(prompts=[("a", ""), ("b", "")], prompt_ids=[[1, 2, 3], [4]],
                              completions=[[5], [5, 6, 7], [8, 9], [1, 2, 3, 4, 5, 6]],
                              rewards=torch.tensor([1.0, 0.0, 0.5, 1.0]), solved=torch.tensor([True, False, False, True]),
                              group_size=2)
    m = core.rollout_metrics(batch)
    assert m == dict(reward=0.625, accuracy=0.5, response_tokens=3.0, response_tokens_max=6, prompt_tokens=2.0,
                     tool_call_rate=0.0)
    batch.model_mask = [[1], [1, 0, 1], [1, 1], [1, 0, 0, 1, 1, 1]]   # two completions hold a tool's output
    assert core.rollout_metrics(batch)["tool_call_rate"] == 0.5


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


def test_hf_rollout_pads_on_the_left_without_a_pad_token(tmp_path):
    """A Llama-3-style tokenizer has no pad token: `tokenizer(..., padding=True)` refuses it. The backend pads
    itself (eos, `chat.pad_id`), leaves the caller's tokenizer as it was, and a near-greedy sample of prompts of
    different lengths in one padded batch equals each prompt sampled alone."""
    from transformers import AutoModelForCausalLM

    from mfsdp_kit.models import archs
    from tests import chat_tokenizers
    tok = chat_tokenizers.llama3()
    assert tok.pad_token is None
    src = archs.write_tiny("LlamaForCausalLM", tmp_path / "llama", vocab_size=256)
    side = tok.padding_side
    rollout = HFRollout(AutoModelForCausalLM.from_pretrained(src), tok)
    task = data.ArithmeticTask(digits=2, tokenizer=tok)
    prompts = [task.prompt(1, "+", 2), task.prompt(12, "+", 34)]
    assert len(set(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts)) == 2
    kw = dict(n=1, max_new_tokens=6, temperature=1.0, top_p=1e-6, seed=0)   # top-p this small: the argmax
    together = rollout.sample(prompts, **kw)
    assert together == [rollout.sample([p], **kw)[0] for p in prompts] and tok.padding_side == side


def test_left_padded_rows_end_where_generation_starts():
    from mfsdp_kit.rl.rollout.hf import left_padded
    enc = left_padded([[5, 6, 7], [8]], pad_id=2, device="cpu")
    assert enc["input_ids"].tolist() == [[5, 6, 7], [2, 2, 8]]
    assert enc["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]


def test_rollout_batch_refuses_to_cut_a_rollout():
    with pytest.raises(ValueError, match=r"^seq_len_tokens=3 .*>= 4: rollout 0 has a 3-token prompt and a 2-token"):
        core.rollout_batch([[5, 6, 7]], [[8, 9]], torch.tensor([0.5]), seq_len_tokens=3, pad_id=0)


def test_the_training_length_comes_from_the_prompt_pool_or_is_refused_before_any_rollout():
    from tests import chat_tokenizers
    tok = chat_tokenizers.qwen()   # its template adds a system turn: prompts far longer than their question
    pool = data.ArithmeticTask(digits=1, tokenizer=tok).rl_prompts(20)
    longest = max(len(tok(p, add_special_tokens=False)["input_ids"]) for p, _ in pool)
    need = core.seq_len_needed(pool, tok, max_new_tokens=4)
    assert need == longest + 3 and core.checked_seq_len(None, pool, tok, max_new_tokens=4) == need
    assert core.checked_seq_len(need + 5, pool, tok, max_new_tokens=4) == need + 5
    for bad in (need - 1, 16.0, True):
        with pytest.raises(ValueError, match=rf"^seq_len_tokens={bad!r} .*None \(= {need}\) or an integer >= {need}"):
            core.checked_seq_len(bad, pool, tok, max_new_tokens=4)


def test_rl_refuses_pipeline_parallelism_before_any_work():
    from tests.dist import launch
    r = launch.run("scenarios_rl:refuses_pipeline_parallel", nproc=2)
    assert r["error"] and "pipeline_model_parallel_size=2 is not allowed" in r["error"], r


def test_an_rl_config_hands_its_micro_batch_fields_to_train_step_options():
    from mfsdp_kit.train import StepOptions, masked_token_loss
    cfg = core.RolloutConfig(micro_batch_size=4, max_tokens_per_micro_batch=512, packed=True)
    assert cfg.step_options(loss_fn=masked_token_loss) == StepOptions(
        micro_batch_size=4, max_tokens_per_micro_batch=512, packed=True, loss_fn=masked_token_loss)
    assert cfg.scoring_options() == StepOptions(micro_batch_size=4, packed=True)   # their own token budget
