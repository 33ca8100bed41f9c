"""rl.rollout.kernels.draw: the one-kernel draw samples `sampling.pick`'s law at top_p 1 (softmax(logits / T)) and
returns each token's log-prob at T; at T 0 the first argmax, scored at T 1; its draws are a function of (seed, step,
row). On a GPU (fp32 and bf16 logits), or on CPU in Triton's interpreter (tests/rl/rollout/kernels/test_attention.py
says how)."""
import os

import pytest
import torch

from mfsdp_kit.config import ConfigError
from mfsdp_kit.rl.rollout.kernels.attention import triton
from tests.rl.rollout.kernels.test_sampling import assert_draws_follow

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(triton is None or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
                                reason="the kernels run on a GPU (Triton), or on CPU in Triton's interpreter")
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


def draw(*args, **kwargs):
    from mfsdp_kit.rl.rollout.kernels.draw import draw as kernel   # imports Triton: after the skip
    return kernel(*args, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [5000, 100])   # three blocks, the last one partial; one block
def test_the_kernel_at_temperature_0_is_the_first_argmax_scored_at_1(dtype, vocab):
    logits = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(0)) * 3).to(DEVICE, dtype)
    top = logits.float().max(-1).values
    logits[1, [vocab - 1, 3]] = top[1].to(dtype) + 1    # a tie across blocks: the lower index wins
    logits[2, [7, 8]] = top[2].to(dtype) + 1            # a tie inside a block
    token, logp = draw(logits, temperature=0, seed=5, step=9)
    assert token.dtype == torch.int64 and torch.equal(token, logits.float().argmax(-1))
    assert token[1] == 3 and token[2] == 7
    torch.testing.assert_close(logp, torch.log_softmax(logits.float(), -1).gather(-1, token[:, None])[:, 0])


def test_the_kernel_reads_masked_and_strided_logits_as_torch_does():
    """A row whose whole first block is -inf (masked tokens) scores like log_softmax (no NaN from the running max),
    and a column-strided view draws what its contiguous copy draws."""
    logits = torch.randn(4, 5000, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    logits[0, :2048] = float("-inf")
    for temperature in (0, 0.9):
        token, logp = draw(logits, temperature=temperature, seed=1, step=0)
        want = torch.log_softmax(logits / (temperature or 1), -1).gather(-1, token[:, None])[:, 0]
        torch.testing.assert_close(logp, want)
        assert token[0] >= 2048
    wide = torch.randn(3, 2 * 700, device=DEVICE)
    assert all(torch.equal(a, b) for a, b in zip(draw(wide[:, ::2], temperature=1.0, seed=0, step=2),
                                                 draw(wide[:, ::2].contiguous(), temperature=1.0, seed=0, step=2)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_draws_softmax_over_t_and_scores_its_tokens(dtype):
    """4,000 rows of the same logits (each row its own draws) against softmax(logits / 0.7): a chi-square test at
    alpha 1e-3, and each log-prob that of log softmax(logits / 0.7). The temperature ignored, or the race's keys
    built with the wrong sign, fails it."""
    logits = (torch.randn(300, generator=torch.Generator().manual_seed(1)) * 1.8).to(DEVICE, dtype)
    token, logp = draw(logits.expand(4000, -1), temperature=0.7, seed=11, step=0)
    want = torch.log_softmax(logits.float() / 0.7, -1)
    assert_draws_follow(token, want.exp())
    torch.testing.assert_close(logp, want[token], rtol=0, atol=1e-5)


def test_the_kernels_draws_are_a_function_of_seed_step_and_row():
    logits = torch.zeros(64, 50, device=DEVICE)   # uniform: every draw is a fresh token
    a = draw(logits, temperature=1.0, seed=3, step=4)[0]
    assert torch.equal(a, draw(logits, temperature=1.0, seed=3, step=4)[0])
    assert not torch.equal(a, draw(logits, temperature=1.0, seed=3, step=5)[0])
    assert not torch.equal(a, draw(logits, temperature=1.0, seed=4, step=4)[0])
    assert len(set(a.tolist())) > 20   # rows of one step draw apart


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [0, 0.9])
def test_a_row_split_over_programs_draws_the_unsplit_tokens_and_scores_them_alike(dtype, temperature):
    """Splits of 2, 3, 5 and more than the blocks (clamped), over 5 blocks with a partial last one: the same tokens
    as one program a row, and the same log-probs to rounding. The rows hold a tie across two splits' blocks (the
    lower token wins at T 0), a whole first split of -inf, and a row whose best token sits in the last split."""
    vocab = 4 * 2048 + 700
    logits = (torch.randn(5, vocab, generator=torch.Generator().manual_seed(4)) * 2).to(DEVICE, dtype)
    top = logits.float().max(-1).values
    logits[0, [3 * 2048 + 5, 2048 + 9]] = top[0].to(dtype) + 30   # a tie far above the rest: both splits' best
    logits[1, :2 * 2048] = float("-inf")
    logits[2, vocab - 1] = top[2].to(dtype) + 30
    one = draw(logits, temperature=temperature, seed=7, step=3, splits=1)
    assert one[0][0] == 2048 + 9 if temperature == 0 else one[0][0] in (2048 + 9, 3 * 2048 + 5)   # T > 0: a race
    assert one[0][2] == vocab - 1 and one[0][1] >= 2 * 2048
    for splits in (2, 3, 5, 64):   # 5 blocks: 3 of 2, 2 and 1 blocks; 2 of 3 and 2; 5 of 1; 64 clamped to 5
        token, logp = draw(logits, temperature=temperature, seed=7, step=3, splits=splits)
        assert torch.equal(token, one[0]), splits
        torch.testing.assert_close(logp, one[1], rtol=0, atol=1e-5)   # the sums in another order
    want = torch.log_softmax(logits.float() / (temperature or 1), -1).gather(-1, one[0][:, None])[:, 0]
    torch.testing.assert_close(one[1], want, rtol=0, atol=1e-5)


def test_a_row_is_split_only_when_the_rows_leave_sms_idle():
    from mfsdp_kit.rl.rollout.kernels.draw import default_splits
    assert default_splits(4, torch.device("cpu")) == 1
    if DEVICE == "cuda":
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert default_splits(4, torch.device("cuda")) == sms // 4 and default_splits(sms, torch.device("cuda")) == 1


def test_split_draws_follow_softmax_over_t():
    """The split path's own chi-square test (`test_the_kernel_draws_softmax_over_t_and_scores_its_tokens`'s),
    over a vocabulary of three blocks split three ways: a split that dropped or doubled a block's tokens fails it."""
    logits = torch.randn(3 * 2048, generator=torch.Generator().manual_seed(5)).to(DEVICE) * 0.05
    logits[:64] += 4   # most of the mass in 64 tokens of the first split: the test's power is there
    token, logp = draw(logits.expand(2000, -1), temperature=0.7, seed=2, step=1, splits=3)
    want = torch.log_softmax(logits.float() / 0.7, -1)
    p = want.exp()
    tails = [p[64:2048].sum(), p[2048:4096].sum(), p[4096:].sum()]   # each split's other tokens, one outcome each
    cell = torch.where(token < 64, token, 64 + token // 2048)
    assert_draws_follow(cell, torch.cat([p[:64], torch.stack(tails)]))
    torch.testing.assert_close(logp, want[token], rtol=0, atol=1e-5)


def test_the_kernel_refuses_a_counter_it_cannot_hold():
    wide = torch.zeros(1, 1, device=DEVICE).expand(2**17, 2**15)   # rows x vocab = 2**32: no memory behind it
    with pytest.raises(ConfigError, match="logits=.*2\\*\\*32"):
        draw(wide, temperature=1.0, seed=0, step=0)
    with pytest.raises(ConfigError, match="step=-1"):
        draw(torch.zeros(2, 8, device=DEVICE), temperature=1.0, seed=0, step=-1)
    with pytest.raises(ConfigError, match="splits=0"):
        draw(torch.zeros(2, 8, device=DEVICE), temperature=1.0, seed=0, step=0, splits=0)


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU: tests/rl/rollout/test_engine.py's kernel sampler test")
def test_the_engine_draws_through_the_kernel_and_scores_its_samples_as_the_model(tmp_path, monkeypatch):
    """The engine's prefills and decode steps drawing through the kernel (`Sampler(kernel=True)`; forced here, where
    the Triton decode kernels do not run, as `DecodeConfig.sampler="triton"` asks on a GPU), fp32: greedy tokens equal
    transformers' `generate`; sampled at T 0.8, each log-prob is the model's teacher-forced log softmax(logits / T), and
    the same seed draws the same tokens, others than the torch sampler's."""
    from tests.rl.rollout.test_engine import ROWS, SMALL, hf_greedy, load
    from mfsdp_kit.rl.rollout import ContinuousRollout
    model, tok = load("Qwen2ForCausalLM", tmp_path)
    kit = ContinuousRollout(model, tok, config=SMALL)
    monkeypatch.setattr(kit.runner, "kernel_draws", lambda: True)
    greedy = kit.generate(ROWS, max_new_tokens=10, temperature=0, top_p=1.0, seed=0)[0]
    assert greedy == hf_greedy(model, tok, ROWS, 10)
    kw = dict(max_new_tokens=8, temperature=0.8, top_p=1.0, seed=3)
    ours, lps = kit.generate(ROWS, **kw)
    assert (ours, lps) == kit.generate(ROWS, **kw)
    assert ContinuousRollout(model, tok, config=SMALL).generate(ROWS, **kw)[0] != ours   # the kernel drew them
    for prompt, completion, lp in zip(ROWS, ours, lps):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits.float() / 0.8, -1).gather(-1, torch.tensor(completion)[:, None])
        assert (torch.tensor(lp) - want[:, 0]).abs().max() <= 1e-4, (lp, want)
