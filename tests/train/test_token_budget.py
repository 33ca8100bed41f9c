"""mfsdp_kit.train.token_budget: the formula's budget and its arithmetic on measured numbers (CPU); on a GPU, the
first training call's measure, the budget re-decided from it once a step has made Adam's moments, and kept."""
import math

import pytest
import torch

from mfsdp_kit.config import EngineConfig
from mfsdp_kit.distributed import engine, introspect, runtime
from mfsdp_kit.models import GPTSpec, gpt_model_fn
from mfsdp_kit.perf import length_mix
from mfsdp_kit.train import packing, token_budget
from tests.dist import launch


@pytest.fixture(scope="module")
def world():
    runtime.init(EngineConfig(), rank=0, world_size=1, master_port=launch.free_port())
    yield
    runtime.shutdown()


def test_a_training_budget_sets_adams_state_aside(world):
    """The training budget is decided before the first optimizer step makes Adam's moments: 8 bytes a trainable
    parameter (this rank's data-parallel share), set aside. Without it a 7.6 B full fine-tune on one H200 took
    half of the 67 GB free for activations, and Adam's 61 GB then ran out of memory (bench/lora.py, 2026-12-04)."""
    cfg = EngineConfig(attention_backend="sdpa")
    model = engine.build(cfg, gpt_model_fn(GPTSpec(hidden_size=64), cfg), wrap=False)[0]
    n = sum(p.numel() for p in model.parameters())
    assert token_budget.optimizer_state_bytes([model]) == 8 * n
    for name, p in model.named_parameters():
        p.requires_grad_("layers.0." in name)            # a frozen base but for one layer (LoRA-like)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert token_budget.optimizer_state_bytes([model]) == 8 * trainable
    gb = 10**9
    per_token = 1_500_000                                # ~ a 7.6 B model's activations a token in training
    assert token_budget.tokens_that_fit(free_bytes=67 * gb, per_token_bytes=per_token) == 22272
    assert token_budget.tokens_that_fit(free_bytes=67 * gb, per_token_bytes=per_token, reserved_bytes=61 * gb) == 1792
    assert token_budget.tokens_that_fit(free_bytes=50 * gb, per_token_bytes=per_token, reserved_bytes=61 * gb) == 0


def test_a_measured_budget_is_what_fits_beside_the_allocated_bytes():
    """The H100 GRPO update of 2026-12-05: 85 GB, ~3.3 GB outside torch, 50.6 GB allocated before the update,
    1.71 MB a token measured -> 13,056 tokens (16,384 ran out of memory there, 12,288 peaked at 71.7 GB)."""
    gb = 10**9
    n = token_budget.measured_tokens(total_bytes=85 * gb, outside_bytes=3.3 * gb, allocated_bytes=50.6 * gb,
                                     per_token_bytes=1.71e6)
    assert n == 13056 and n % 256 == 0
    assert 50.6 * gb + n * 1.71e6 <= (1 - token_budget.HEADROOM_FRACTION) * 85 * gb - 3.3 * gb
    assert token_budget.measured_tokens(total_bytes=85 * gb, outside_bytes=3.3 * gb, allocated_bytes=80 * gb,
                                        per_token_bytes=1.71e6) == 0   # nothing left: 0 (memory_budget keeps 256)


def test_nothing_is_measured_off_a_gpu(world):
    cfg = EngineConfig(attention_backend="sdpa")
    chunks = [engine.build(cfg, gpt_model_fn(GPTSpec(hidden_size=64), cfg), wrap=False)[0]]
    b = length_mix.batch([(1, 4), (3, 24)], seq_len_tokens=24, vocab_size=50)
    mbs = packing.rank_micro_batches(b, max_tokens_per_micro_batch=48)
    assert packing.largest_packed(mbs) == 28 and packing.largest_packed([]) is None
    with token_budget.measuring(chunks, largest=packing.largest_packed(mbs), forward_only=False):
        pass
    assert token_budget.measured_bytes_per_token(chunks) is None


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
    b = length_mix.batch([(8, 40), (8, 200)] * 8, seq_len_tokens=256, vocab_size=spec.vocab_size)   # 1,920 tokens
    budgets, measures = [], []
    for i in range(3):
        step(chunks, opt, b, micro_batch_size=2, step_index=i)
        budgets.append(token_budget.decided_budgets(chunks)[False])
        measures.append(token_budget.measured_bytes_per_token(chunks))
    per_token = measures[0]
    assert per_token is not None and per_token > 0 and measures == [per_token] * 3    # measured once, kept
    assert budgets[1] == budgets[2] and budgets[1] % 256 == 0
    free, total = torch.cuda.mem_get_info()
    now = token_budget.measured_tokens(total_bytes=total, outside_bytes=total - free - torch.cuda.memory_reserved(),
                                       allocated_bytes=torch.cuda.memory_allocated(), per_token_bytes=per_token)
    assert abs(budgets[1] - now) <= 512, (budgets, now, per_token)   # the room beside the model, as it is now
    assert budgets[1] * per_token <= total * (1 - token_budget.HEADROOM_FRACTION)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a device's peak memory is measured on a GPU")
def test_a_budget_is_measured_only_from_a_full_enough_call_after_a_real_step_on_a_gpu(world):
    """A first call whose micro-batch is under MEASURE_MIN_TOKENS measures nothing (a filler's one-off bytes are not
    bytes per token): the formula's budget stays. fp16 skips a step whose scaled gradients overflow (megatron's loss
    scale starts at 2**32), and then Adam's moments do not exist yet: the budget is re-decided only after a step that
    updated the model. Here the first step is made to overflow (scale 2**40), the next ones not (scale 1)."""
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
        budgets.append(token_budget.decided_budgets(chunks)[False])
    assert math.isnan(token_budget.measured_bytes_per_token(chunks)) and budgets[0] == budgets[1]

    cfg = EngineConfig(use_megatron_fsdp=True, dtype="fp16", attention_backend="sdpa")
    chunks = engine.build(cfg, gpt_model_fn(spec, cfg))
    opt = engine.build_optimizer(chunks, OptimConfig(lr=1e-4), cfg)
    b = length_mix.batch([(8, 40), (8, 200)] * 8, seq_len_tokens=256, vocab_size=spec.vocab_size)
    formula, stepped_at = None, None
    for i in range(4):
        for o in introspect.inner_optimizers(opt):   # read each time: the scaler replaces its tensor as it moves
            o.grad_scaler.scale.fill_(2.0 ** 40 if i == 0 else 1.0)
        result = step(chunks, opt, b, micro_batch_size=2, step_index=i)
        formula = formula or token_budget.decided_budgets(chunks)[False]
        if stepped_at is None:   # up to the first step that updated the model, nothing is re-decided
            assert token_budget.decided_budgets(chunks)[False] == formula, i
            stepped_at = None if result.skipped else i
        else:                    # the call after it is
            break
    assert stepped_at == 1, stepped_at   # the overflowing first step was skipped, the second updated the model
    assert token_budget.decided_budgets(chunks)[False] != formula


def test_activation_bytes_per_token_write_out_the_layer():
    """The l shape (28 layers, hidden 2048, GQA 16/4 x 128, SwiGLU 8192), bf16: 2 x (8h + 3gd + 3f) = 84,992 bytes a
    layer in training (2.38 MB for 28), the loss (2 + 12) V; without grad one layer's widest tensors, (5h + 3gd + 3f)."""
    from types import SimpleNamespace
    c = SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, params_dtype=torch.bfloat16,
                        hidden_size=2048, kv_channels=128, ffn_hidden_size=8192, num_query_groups=4, num_layers=28,
                        gated_linear_unit=True)
    train = token_budget.activation_bytes_per_token(c, vocab_size=1000, forward_only=False)
    assert train == 28 * 2 * (8 * 2048 + 3 * 512 + 3 * 8192) + 14 * 1000
    assert token_budget.activation_bytes_per_token(c, vocab_size=1000, forward_only=True) == \
        2 * (5 * 2048 + 3 * 512 + 3 * 8192) + 10 * 1000
    c.tensor_model_parallel_size = 2   # the split matrices' activations halve, the residual stream does not
    assert token_budget.activation_bytes_per_token(c, vocab_size=1000, forward_only=False) == \
        28 * 2 * (8 * 2048 + 3 * 256 + 3 * 4096) + 14 * 500
