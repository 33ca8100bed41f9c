"""rl.rollout.static: its decode loop computes the HF model's function (greedy tokens equal `generate`'s for
every architecture it allows, written by transformers itself), samples the law it states (temperature,
top-p), reproducibly, and refuses what it cannot run by name. fp32 on CPU."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mfsdp_kit.config import ConfigError
from mfsdp_kit.generate import cut_at_stop
from mfsdp_kit.models.archs import write_tiny
from mfsdp_kit.rl.rollout import RolloutBackend
from mfsdp_kit.rl.rollout.hf import left_padded
from mfsdp_kit.rl.rollout.static import SUPPORTED, StaticCacheRollout, check_model

ROWS = [[5, 17, 42, 9, 77, 3, 120], [8, 8, 200], [31, 64, 2 + 9, 150, 151]]   # three lengths: left padding


def load(arch, tmp_path):
    folder = write_tiny(arch, tmp_path / arch)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("arch", SUPPORTED)
def test_greedy_tokens_equal_transformers_generate(arch, tmp_path):
    model, tok = load(arch, tmp_path)
    rollout = StaticCacheRollout(model, tok)
    assert isinstance(rollout, RolloutBackend)
    ours = rollout.generate(ROWS, max_new_tokens=32, temperature=0, top_p=1.0, seed=0).tolist()
    enc = left_padded(ROWS, pad_id=tok.eos_token_id, device="cpu")
    theirs = model.generate(**enc, do_sample=False, max_new_tokens=32, pad_token_id=tok.eos_token_id)
    theirs = theirs[:, enc["input_ids"].shape[1]:].tolist()
    stops = [tok.eos_token_id]
    for mine, ref in zip(ours, theirs):
        assert cut_at_stop(mine, stops) == cut_at_stop(ref, stops)[:len(mine)], (arch, mine, ref)
    assert max(map(len, ours)) == 32 or all(tok.eos_token_id in row for row in ours)


def test_same_seed_same_samples(tmp_path):
    model, tok = load("Qwen2ForCausalLM", tmp_path)
    rollout = StaticCacheRollout(model, tok)
    kw = dict(max_new_tokens=12, temperature=1.0, top_p=0.95)
    a, b = rollout.generate(ROWS * 4, seed=1, **kw), rollout.generate(ROWS * 4, seed=1, **kw)   # b: a's kept cache
    assert torch.equal(a, b) and not torch.equal(a, rollout.generate(ROWS * 4, seed=2, **kw))
    rollout.generate(ROWS[:2], seed=1, **kw)   # another shape: a new cache
    rollout.release()
    assert torch.equal(a, rollout.generate(ROWS * 4, seed=1, **kw))


def test_first_token_follows_softmax_over_t_cut_to_top_p(tmp_path):
    """10k first tokens at T 0.7 / top_p 0.9 against softmax(logits / T) truncated to the top-p set: no draw
    outside the set, and a chi-square test at alpha 1e-3 (Wilson-Hilferty's quantile)."""
    model, tok = load("LlamaForCausalLM", tmp_path)
    with torch.no_grad():   # a sharper model than random init gives: the top-p cut then removes many tokens
        model.lm_head.weight.mul_(8.0)
        logits = model(torch.tensor([ROWS[0]])).logits[0, -1]
    probs = torch.softmax(logits / 0.7, -1)
    sorted_p, order = probs.sort(descending=True)
    keep = order[(sorted_p.cumsum(0) - sorted_p) < 0.9]
    expected = torch.zeros_like(probs)
    expected[keep] = probs[keep] / probs[keep].sum()
    assert 2 < len(keep) < len(probs) // 2, len(keep)   # the cut matters in this test
    draws = StaticCacheRollout(model, tok).generate([ROWS[0]] * 10_000, max_new_tokens=1, temperature=0.7,
                                                    top_p=0.9, seed=0)[:, 0]
    counts = torch.bincount(draws, minlength=len(probs)).double()
    assert counts[expected == 0].sum() == 0, "a token outside the top-p set was drawn"
    e = expected.double() * len(draws)
    big = e >= 5
    observed = torch.cat([counts[big], counts[~big & (expected > 0)].sum().reshape(1)])
    wanted = torch.cat([e[big], e[~big & (expected > 0)].sum().reshape(1)])
    observed, wanted = observed[wanted > 0], wanted[wanted > 0]
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    df = len(wanted) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < critical, (chi2, critical, df)


def test_refuses_what_it_cannot_run_by_name(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ConfigError, match="does not run GPT2LMHeadModel; allowed: LlamaForCausalLM"):
        check_model(gpt2, max_len_tokens=16)
    mistral, _ = load("MistralForCausalLM", tmp_path)
    mistral.config.sliding_window = 8
    with pytest.raises(ConfigError, match="sliding_window=8 is not allowed"):
        check_model(mistral, max_len_tokens=16)
    check_model(mistral, max_len_tokens=8)
