"""Packed sequences and token-budget micro-batches (mfsdp_kit.train.packing) against the padded run they replace."""
import math

import pytest
import torch

from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.train import packing
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
    assert packing.memory_budget(chunks, forward_only=False) is None          # host memory is not the limit
    assert packing.budget(chunks, b, micro_batch_size=2) == 2 * 24
    assert packing.budget(chunks, b, micro_batch_size=2, max_tokens_per_micro_batch=30) == 30


def test_a_training_budget_sets_adams_state_aside(world):
    """The training budget is decided before the first optimizer step makes Adam's moments: 8 bytes a trainable
    parameter (this rank's data-parallel share), set aside. Without it a 7.6 B full fine-tune on one H200 took
    half of the 67 GB free for activations, and Adam's 61 GB then ran out of memory (bench/lora.py, 2026-12-04)."""
    cfg = EngineConfig(attention_backend="sdpa")
    model = engine.build(cfg, gpt_model_fn(GPTSpec(hidden_size=64), cfg), wrap=False)[0]
    n = sum(p.numel() for p in model.parameters())
    assert packing.optimizer_state_bytes([model]) == 8 * n
    for name, p in model.named_parameters():
        p.requires_grad_("layers.0." in name)            # a frozen base but for one layer (LoRA-like)
    assert packing.optimizer_state_bytes([model]) == 8 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    gb = 10**9
    per_token = 1_500_000                                # ~ a 7.6 B model's activations a token in training
    assert packing.tokens_that_fit(free_bytes=67 * gb, per_token_bytes=per_token) == 22272
    assert packing.tokens_that_fit(free_bytes=67 * gb, per_token_bytes=per_token, reserved_bytes=61 * gb) == 1792
    assert packing.tokens_that_fit(free_bytes=50 * gb, per_token_bytes=per_token, reserved_bytes=61 * gb) == 0


def test_a_measured_budget_is_what_fits_beside_the_allocated_bytes():
    """The H100 GRPO update of 2026-12-05: 85 GB, ~3.3 GB outside torch, 50.6 GB allocated before the update,
    1.71 MB a token measured -> 13,056 tokens (16,384 ran out of memory there, 12,288 peaked at 71.7 GB)."""
    gb = 10**9
    n = packing.measured_tokens(total_bytes=85 * gb, outside_bytes=3.3 * gb, allocated_bytes=50.6 * gb,
                                per_token_bytes=1.71e6)
    assert n == 13056 and n % 256 == 0
    assert 50.6 * gb + n * 1.71e6 <= (1 - packing.HEADROOM_FRACTION) * 85 * gb - 3.3 * gb
    assert packing.measured_tokens(total_bytes=85 * gb, outside_bytes=3.3 * gb, allocated_bytes=80 * gb,
                                   per_token_bytes=1.71e6) == 0      # nothing left: 0 (memory_budget keeps 256)


def test_nothing_is_measured_off_a_gpu(world):
    cfg = EngineConfig(attention_backend="sdpa")
    chunks = [engine.build(cfg, gpt_model_fn(GPTSpec(hidden_size=64), cfg), wrap=False)[0]]
    b = length_mix.batch([(1, 4), (3, 24)], seq_len_tokens=24, vocab_size=50)
    mbs = packing.rank_micro_batches(b, max_tokens_per_micro_batch=48)
    with packing.measuring(chunks, mbs, forward_only=False):
        pass
    assert packing.measured_bytes_per_token(chunks) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a device's peak memory is measured on a GPU")
def test_the_training_budget_is_measured_at_the_first_step_on_a_gpu(world):
    """One GPU rank: the first packed step plans with the formula and measures its peak bytes per token; the second
    re-decides the budget from that measure (what fits beside the allocated bytes); the third keeps it."""
    from mfsdp_kit.config import OptimConfig
    from mfsdp_kit.train import step
    cfg = EngineConfig(use_megatron_fsdp=True, dtype="bf16", attention_backend="sdpa")
    spec = GPTSpec(num_layers=2, hidden_size=256, num_attention_heads=4, seq_len_tokens=256)
    chunks = engine.build(cfg, gpt_model_fn(spec, cfg))
    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-4), cfg)
    b = length_mix.batch([(8, 40), (8, 200)], seq_len_tokens=256, vocab_size=spec.vocab_size)
    budgets, measures = [], []
    for i in range(3):
        step(chunks, opt, b, micro_batch_size=2, step_index=i)
        budgets.append(packing.decided_budgets(chunks)[False])
        measures.append(packing.measured_bytes_per_token(chunks))
    per_token = measures[0]
    assert per_token is not None and per_token > 0 and measures == [per_token] * 3    # measured once, kept
    assert budgets[1] == budgets[2] and budgets[1] % 256 == 0
    free, total = torch.cuda.mem_get_info()
    now = packing.measured_tokens(total_bytes=total, outside_bytes=total - free - torch.cuda.memory_reserved(),
                                  allocated_bytes=torch.cuda.memory_allocated(), per_token_bytes=per_token)
    assert abs(budgets[1] - now) <= 512, (budgets, now, per_token)   # the room beside the model, as it is now
    assert budgets[1] * per_token <= total * (1 - packing.HEADROOM_FRACTION)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a device's peak memory is measured on a GPU")
def test_a_budget_is_measured_only_from_a_full_enough_call_after_a_real_step_on_a_gpu(world):
    """A first call whose micro-batch is under MEASURE_MIN_TOKENS measures nothing (a filler's one-off bytes are not
    bytes per token): the formula's budget stays. In fp16 the first steps are skipped (loss scale 2**32), so Adam's
    moments do not exist yet: the budget is re-decided only after a step that updated the model."""
    from mfsdp_kit.config import OptimConfig
    from mfsdp_kit.train import step
    spec = GPTSpec(num_layers=2, hidden_size=256, num_attention_heads=4, seq_len_tokens=256)
    cfg = EngineConfig(use_megatron_fsdp=True, dtype="bf16", attention_backend="sdpa")
    chunks = engine.build(cfg, gpt_model_fn(spec, cfg))
    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-4), cfg)
    small = length_mix.batch([(4, 40)], seq_len_tokens=256, vocab_size=spec.vocab_size)   # 160 tokens
    budgets = []
    for i in range(2):
        step(chunks, opt, small, micro_batch_size=2, step_index=i)
        budgets.append(packing.decided_budgets(chunks)[False])
    assert math.isnan(packing.measured_bytes_per_token(chunks)) and budgets[0] == budgets[1]

    cfg = EngineConfig(use_megatron_fsdp=True, dtype="fp16", attention_backend="sdpa")
    chunks = engine.build(cfg, gpt_model_fn(spec, cfg))
    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-4), cfg)
    b = length_mix.batch([(8, 40), (8, 200)], seq_len_tokens=256, vocab_size=spec.vocab_size)
    formula, stepped_at = None, None
    for i in range(40):
        result = step(chunks, opt, b, micro_batch_size=2, step_index=i)
        formula = formula or packing.decided_budgets(chunks)[False]
        if stepped_at is None:   # up to the first step that updated the model, nothing is re-decided
            assert packing.decided_budgets(chunks)[False] == formula, i
            stepped_at = None if result.skipped else i
        else:                    # the call after it is
            break
    assert stepped_at is not None and stepped_at > 0, stepped_at   # megatron's fp16 scale skipped the first steps
    assert packing.decided_budgets(chunks)[False] != formula


def test_activation_bytes_per_token_write_out_the_layer():
    """The l shape (28 layers, hidden 2048, GQA 16/4 x 128, SwiGLU 8192), bf16: 2 x (8h + 3gd + 3f) = 84,992 bytes a
    layer in training (2.38 MB for 28), the loss (2 + 12) V; without grad one layer's widest tensors, (5h + 3gd + 3f)."""
    from types import SimpleNamespace
    c = SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, params_dtype=torch.bfloat16,
                        hidden_size=2048, kv_channels=128, ffn_hidden_size=8192, num_query_groups=4, num_layers=28,
                        gated_linear_unit=True)
    train = packing.activation_bytes_per_token(c, vocab_size=1000, forward_only=False)
    assert train == 28 * 2 * (8 * 2048 + 3 * 512 + 3 * 8192) + 14 * 1000
    assert packing.activation_bytes_per_token(c, vocab_size=1000, forward_only=True) == \
        2 * (5 * 2048 + 3 * 512 + 3 * 8192) + 10 * 1000
    c.tensor_model_parallel_size = 2   # the split matrices' activations halve, the residual stream does not
    assert packing.activation_bytes_per_token(c, vocab_size=1000, forward_only=False) == \
        28 * 2 * (8 * 2048 + 3 * 256 + 3 * 4096) + 14 * 500


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
