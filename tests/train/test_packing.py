"""Packed sequences and token-budget micro-batches (mfsdp_kit.train.packing) against the padded run they replace."""
import pytest
import torch

from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.train import packing, token_budget
from mfsdp_kit.config import ConfigError, EngineConfig
from mfsdp_kit.train.data import Batch
from mfsdp_kit.models import GPTSpec, gpt_model_fn
from mfsdp_kit.train.parity import compare_curves
from mfsdp_kit.perf import length_mix
from tests.dist import launch

SKEWED = [900, 30, 25, 20, 700, 15, 12, 10, 8, 8, 5, 3, 0, 400]
"""A skewed mix: a few long sequences, many short ones, one with no loss token."""


def test_loss_lengths_stop_at_the_last_loss_token():
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 0, 1]]).float()
    b = Batch(torch.zeros(4, 5, dtype=torch.long), torch.zeros(4, 5, dtype=torch.long), mask)
    assert packing.loss_lengths(b) == [3, 0, 5, 5]
    assert packing.padding_fraction(b) == pytest.approx(1 - 13 / 20)


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_plan_is_balanced_under_the_budget_with_equal_forwards(dp):
    budget = 1000
    plan = packing.plan(SKEWED, dp_size=dp, max_tokens_per_micro_batch=budget)
    seen = sorted(i for rank in plan for mb in rank for i in mb)
    assert seen == [i for i, n in enumerate(SKEWED) if n > 0]   # each sequence once, the empty one left out
    assert len({len(rank) for rank in plan}) == 1               # every rank runs the same number of forwards
    assert all(sum(SKEWED[i] for i in mb) <= budget for rank in plan for mb in rank)
    loads = [sum(SKEWED[i] for mb in rank for i in mb) for rank in plan]
    assert max(loads) - min(loads) <= max(SKEWED), loads         # balanced to within one sequence
    alone = packing.plan(SKEWED, dp_size=1, max_tokens_per_micro_batch=budget)
    assert len(plan[0]) <= len(alone[0])                         # never more forwards than one rank would run


def test_plan_refuses_a_sequence_over_the_budget():
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch=800 .*900 tokens"):
        packing.plan(SKEWED, dp_size=2, max_tokens_per_micro_batch=800)


def test_more_ranks_than_sequences_get_a_filler_forward():
    plan = packing.plan([5, 0, 3], dp_size=4, max_tokens_per_micro_batch=8)
    assert [len(r) for r in plan] == [1, 1, 1, 1] and plan[2:] == [[[]], [[]]]
    b = length_mix.batch([(1, 5), (1, 1), (1, 3)], seq_len_tokens=6, vocab_size=50)
    filler = packing.pack(b, [], packing.loss_lengths(b))
    assert filler.filler and filler.tokens.shape == (1, 1) and filler.rows.loss_mask.sum() == 0


def test_pack_then_unpack_is_the_padded_rows_without_their_padding():
    b = length_mix.batch([(2, 7), (1, 3), (4, 12)], seq_len_tokens=12, vocab_size=50, seed=1)
    lengths = packing.loss_lengths(b)
    mb = packing.pack(b, [2, 0, 1], lengths)
    assert mb.tokens.shape == (1, 22) and mb.cu_seqlens.tolist() == [0, 12, 19, 22]
    assert mb.position_ids[0].tolist() == list(range(12)) + list(range(7)) + list(range(3))   # RoPE restarts
    back = mb.unpack(mb.labels.float())
    keep = torch.arange(12) < torch.tensor([12, 7, 3]).unsqueeze(1)
    assert torch.equal(back, torch.where(keep, b.labels[[2, 0, 1]].float(), 0.0))
    assert torch.equal(mb.rows.loss_mask, b.loss_mask[[2, 0, 1]])


@pytest.fixture(scope="module")
def world():
    runtime.init(EngineConfig(), rank=0, world_size=1, master_port=launch.free_port())
    yield
    runtime.shutdown()


@pytest.mark.parametrize("heads", [dict(num_attention_heads=4), dict(num_attention_heads=4, num_query_groups=2)],
                         ids=["mha", "gqa"])
def test_gpt_on_a_packed_row_gives_the_padded_losses_and_grads(world, heads):
    """The kit's GPT (RoPE, SDPA), one rank: per-token losses of a packed row, unpacked, equal the padded
    batch's on every loss token (RoPE restarts, no attention across sequences), and so do the gradients of
    the masked sum; padding positions are exact zeros."""
    spec = GPTSpec(hidden_size=64, vocab_size=128, seq_len_tokens=24, **heads)
    b = length_mix.batch([(3, 24), (1, 5), (10, 17), (2, 2)], seq_len_tokens=24, vocab_size=128, seed=2)
    cfg = EngineConfig(attention_backend="sdpa")
    model = engine.build(cfg, gpt_model_fn(spec, cfg), wrap=False)[0]
    losses, grads = {}, {}
    for how in ("padded", "packed"):
        model.zero_grad()
        if how == "padded":
            per_token = model(b.tokens, torch.arange(24).expand(4, 24), None, labels=b.labels)
        else:
            per_token = packing.pack(b, [0, 1, 2, 3], packing.loss_lengths(b)).forward(model)
            per_token = packing.pack(b, [0, 1, 2, 3], packing.loss_lengths(b)).unpack(per_token)
        (per_token * b.loss_mask).sum().backward()
        losses[how] = per_token.detach()
        grads[how] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    on = b.loss_mask.bool()
    print("loss max|diff|", (losses["padded"] - losses["packed"])[on].abs().max().item(),
          "grad max|diff|", (grads["padded"] - grads["packed"]).abs().max().item())
    assert torch.allclose(losses["packed"][on], losses["padded"][on], rtol=0, atol=1e-5)
    assert torch.allclose(grads["packed"], grads["padded"], rtol=0, atol=1e-5)
    assert losses["packed"][torch.arange(24) >= torch.tensor([24, 5, 17, 2]).unsqueeze(1)].abs().sum() == 0


def test_a_local_attention_model_is_refused_by_name(world):
    cfg = EngineConfig(attention_backend="local")
    chunks = [engine.build(cfg, gpt_model_fn(GPTSpec(hidden_size=64), cfg), wrap=False)[0]]
    b = length_mix.batch([(1, 4)], seq_len_tokens=4, vocab_size=50)
    assert packing.budget(chunks, b, micro_batch_size=2) is None               # where it cannot: padded
    with pytest.raises(ConfigError, match="attention_backend='sdpa'"):
        packing.budget(chunks, b, micro_batch_size=2, packed=True)


def test_the_default_attention_on_cpu_runs_padded_and_says_why_once(world, capsys):
    """EngineConfig() picks "auto" attention: megatron's local kernels on CPU, so the model runs padded rows; one
    line says why, once per model."""
    cfg = EngineConfig()
    chunks = [engine.build(cfg, gpt_model_fn(GPTSpec(hidden_size=64), cfg), wrap=False)[0]]
    b = length_mix.batch([(1, 4)], seq_len_tokens=4, vocab_size=50)
    assert packing.budget(chunks, b, micro_batch_size=2) is None
    assert packing.budget(chunks, b, micro_batch_size=2) is None
    out = capsys.readouterr().out
    assert out.count("padded micro-batches: megatron's 'local' attention") == 1, out


def test_the_budget_on_cpu_is_rows_of_the_batch_and_from_memory_none(world):
    cfg = EngineConfig(attention_backend="sdpa")
    chunks = [engine.build(cfg, gpt_model_fn(GPTSpec(hidden_size=64), cfg), wrap=False)[0]]
    b = length_mix.batch([(1, 4), (3, 24)], seq_len_tokens=24, vocab_size=50)
    assert token_budget.memory_budget(chunks, forward_only=False) is None   # host memory is not the limit
    assert packing.budget(chunks, b, micro_batch_size=2) == 2 * 24
    assert packing.budget(chunks, b, micro_batch_size=2, max_tokens_per_micro_batch=30) == 30


# ---- real gloo ranks ------------------------------------------------------------------------
def same_run(padded: dict, packed: dict):
    report = compare_curves(padded["losses"], packed["losses"], exact_steps=len(padded["losses"]),
                            reference_grad_norm=padded["grad_norms"], candidate_grad_norm=packed["grad_norms"])
    print(report)
    report.check()
    assert padded["tokens"] == packed["tokens"]
    a, b = torch.tensor(padded["logprobs"]), torch.tensor(packed["logprobs"])
    print("log-prob max|diff|", (a - b).abs().max().item())
    assert torch.allclose(a, b, rtol=0, atol=1e-5) and a.abs().sum() > 0


@pytest.mark.parity
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_packed_training_matches_padded_on_two_ranks(fsdp):
    """Losses, grad norms and per-token log-probs (`rl.core.token_logprobs`) of 3 steps on skewed batches:
    packed (at the default budget, micro_batch_size rows' worth) == padded."""
    padded, packed = launch.run("sequence", nproc=2, calls=[
        ["scenarios_packing:train_run", dict(fsdp=fsdp, packed=False)],
        ["scenarios_packing:train_run", dict(fsdp=fsdp, packed=True)]])
    same_run(padded, packed)


@pytest.mark.parity
def test_packed_training_matches_padded_at_tp2():
    """DDP and Megatron-FSDP at TP 2 x DP 2, one 4-rank job; a token budget of 60 (not the default) packed."""
    runs = launch.run("sequence", nproc=4, calls=[
        ["scenarios_packing:train_run", dict(fsdp=fsdp, tp=2, packed=packed,
                                             max_tokens_per_micro_batch=60 if packed else None)]
        for fsdp in (False, True) for packed in (False, True)])
    same_run(*runs[:2])
    same_run(*runs[2:])


@pytest.mark.parity
def test_token_budget_gradient_equals_fixed_micro_batches():
    """One skewed global batch of 16 on 2 DDP ranks: the gradient, loss and token count of token-budget
    micro-batches (48 and 200 tokens) equal those of fixed micro-batches of 2 and 8 padded rows."""
    runs = launch.run("sequence", nproc=2, calls=[
        ["scenarios_packing:first_grads", dict(packed=False, micro_batch_size=2, global_batch=16)],
        ["scenarios_packing:first_grads", dict(packed=False, micro_batch_size=8, global_batch=16)],
        ["scenarios_packing:first_grads", dict(packed=True, max_tokens_per_micro_batch=48, global_batch=16)],
        ["scenarios_packing:first_grads", dict(packed=True, max_tokens_per_micro_batch=200, global_batch=16)]])
    ref = torch.tensor(runs[0]["grads"])
    for r in runs[1:]:
        diff = (torch.tensor(r["grads"]) - ref).abs().max().item()
        print("grad max|diff|", diff, "loss", r["loss"], runs[0]["loss"])
        assert diff < 1e-6 * max(1.0, ref.abs().max().item()) and r["tokens"] == runs[0]["tokens"]
        assert r["loss"] == pytest.approx(runs[0]["loss"], rel=1e-6)
    assert ref.abs().sum() > 0


@pytest.mark.parity
def test_grpo_update_packed_matches_padded():
    """rl.core.update with GRPO's sequence-level loss, 2 minibatches x 2 epochs on Megatron-FSDP: the loss
    function reads per-sequence advantages and per-token old/ref log-probs of the padded rows in both runs, so
    losses, grad norms, KL, clip fraction and entropy agree."""
    padded, packed = launch.run("sequence", nproc=2, calls=[["scenarios_packing:rl_update", dict(packed=False)],
                                                            ["scenarios_packing:rl_update", dict(packed=True)]])
    report = compare_curves(padded["losses"], packed["losses"], exact_steps=4,
                            reference_grad_norm=padded["grad_norms"], candidate_grad_norm=packed["grad_norms"])
    print(report, padded["metrics"][-1], packed["metrics"][-1])
    report.check()
    for a, b in zip(padded["metrics"], packed["metrics"]):
        assert a.keys() == b.keys() and all(b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7) for k in a)
    assert padded["metrics"][-1]["clip_frac"] > 0   # the ratio moved: the second epoch saw the first's update
