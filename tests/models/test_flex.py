"""FlexAttention (attention_backend="flex") against SDPAttention's packed path, one gloo rank, fp32 on CPU:
forwards only (torch has no CPU backward for flex_attention; the GPU bench trains with it)."""
import pytest
import torch

from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.train import generate
from mfsdp_kit.config import EngineConfig
from mfsdp_kit.models import GPTSpec, gpt_model_fn
from mfsdp_kit.models.flex import FlexAttention


@pytest.fixture(scope="module", autouse=True)
def world():
    from tests.dist.launch import free_port
    runtime.init(EngineConfig(), rank=0, world_size=1, master_port=free_port())
    yield
    runtime.shutdown()


def _chunks(backend: str):
    cfg = EngineConfig(attention_backend=backend)
    runtime.set_seed(cfg.seed)
    return engine.build(cfg, gpt_model_fn(GPTSpec(hidden_size=64, vocab_size=128, seq_len_tokens=24,
                                                  num_attention_heads=4, num_query_groups=2), cfg))


def test_flex_packed_logits_equal_sdpa_per_sequence():
    """Rows of 24, 5, 17 and 2 tokens in one packed forward: flex's document mask == one SDPA per sequence."""
    tokens = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(0))
    lengths = [24, 5, 17, 2]
    out = {b: generate.logits(_chunks(b), tokens, lengths=lengths) for b in ("sdpa", "flex")}
    diff = (out["sdpa"] - out["flex"]).abs().max().item()
    print("max|flex - sdpa|", diff)
    assert diff < 1e-5 and out["flex"].abs().sum() > 0


def test_flex_runs_eagerly_where_inductor_has_no_cpu_kernel(monkeypatch):
    """Under ATEN_CPU_CAPABILITY=default (as without AVX2) inductor refuses to compile flex_attention for a CPU:
    the packed forward runs torch's eager flex instead, with the same logits as one SDPA per sequence."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")   # inductor reads it at each compile
    from mfsdp_kit.models import flex
    assert flex.flex_kernel(torch.device("cpu")) is flex.eager_flex
    test_flex_packed_logits_equal_sdpa_per_sequence()


def test_training_with_flex_on_cpu_is_refused_by_name():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType
    chunks = _chunks("flex")
    core = next(m for m in chunks[0].modules() if isinstance(m, FlexAttention))
    q = torch.randn(6, 4, 16, requires_grad=True)
    kv = torch.randn(6, 2, 16, requires_grad=True)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, max_seqlen_kv=4)
    with pytest.raises(NotImplementedError, match="use attention_backend='sdpa' on CPU"):
        core(q, kv, kv, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
