"""models.triton_fusions (`kernels.fusion_kernels="triton"`): RoPE and SwiGLU, forward and backward, equal megatron's
unfused functions on q and on k (a strided slice of a fused qkv output, as megatron passes it), padded and packed,
with a partial rotary width, and a whole GPT's loss and grads equal the unfused ones. On a GPU, or on CPU in Triton's
interpreter (TRITON_INTERPRET=1, fp32; tests/rl/rollout/kernels/test_attention.py says how to run it). The config
checks run everywhere."""
import re

import pytest
import torch
import torch.nn.functional as F

from mfsdp_kit import compat
from mfsdp_kit.config import ConfigError, EngineConfig, Kernels
from mfsdp_kit.distributed import runtime
from mfsdp_kit.models import fusions

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels_run = pytest.mark.skipif(not fusions.triton_runs(on_gpu=DEVICE == "cuda"), reason="the kernels run on a GPU (Triton), or on CPU in its interpreter")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


@pytest.fixture(scope="module", autouse=True)
def world():
    from tests.dist.launch import free_port
    runtime.init(EngineConfig(), rank=0, world_size=1, master_port=free_port())
    yield
    runtime.shutdown()


@pytest.fixture
def torch_slots_after():
    """megatron's RoPE and SwiGLU slots are process-wide: put the compiled ones back for the tests after this one."""
    yield
    compat.apply("rope", slots=fusions.ROPE_SLOTS["torch"])
    compat.apply("swiglu", kernel=None)


def _out_and_grad(fn, t: torch.Tensor, weights: torch.Tensor):
    """fn(t) and d sum(fn(t) * weights) / d t, in fp32."""
    x = t.detach().clone().requires_grad_()
    out = fn(x)
    (out.float() * weights).sum().backward()
    return out.detach().float(), x.grad.float()


def _check(ours, want, dtype):
    for a, b in zip(ours, want):
        torch.testing.assert_close(a, b, **TOL[dtype])


@kernels_run
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot_dim", [16, 8], ids=["full", "partial"])
def test_rope_on_q_and_k_equals_megatron_unfused(dtype, rot_dim):
    """q: a view of megatron's fused qkv output, k: a strided slice of it (2 groups of 4 q heads, k, v); b = 2."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    g = torch.Generator().manual_seed(0)
    mixed = torch.randn(12, 2, 2, 6 * 16, generator=g).to(DEVICE, dtype)
    q, k = mixed[..., :64].reshape(12, 2, 8, 16), mixed[..., 64:80]
    freqs = (torch.rand(12, 1, 1, rot_dim, generator=g) * 6.28).to(DEVICE)
    for t in (q, k):
        weights = torch.randn(t.shape, generator=g).to(DEVICE)
        want = _out_and_grad(lambda x: _apply_rotary_pos_emb_bshd(x.float(), freqs), t, weights)
        ours = _out_and_grad(lambda x: fusions.rope(x, freqs, kernels="triton"), t, weights)
        _check(ours, want, dtype)
        if rot_dim < 16:   # dims past rot_dim pass through untouched, forward and backward
            assert torch.equal(ours[0][..., rot_dim:], t[..., rot_dim:].float())
            assert torch.equal(ours[1][..., rot_dim:], weights[..., rot_dim:].to(dtype).float())


@kernels_run
@pytest.mark.parametrize("heads,dim,rot_dim", [(12, 128, 96), (40, 128, 128), (5, 80, 80)],
                         ids=["12-heads-partial", "two-head-blocks", "5-heads-dim-80"])
def test_rope_at_head_counts_that_fill_no_block(heads, dim, rot_dim):
    """Head counts that are not a power of two (the tile's spare rows masked), and more heads than one program takes
    (4096 elements: 32 heads of 128), on a strided view."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    g = torch.Generator().manual_seed(5)
    t = torch.randn(3, 2, heads, dim + 16, generator=g).to(DEVICE)[..., :dim]   # rows strided past the head
    freqs = (torch.rand(3, 1, 1, rot_dim, generator=g) * 6.28).to(DEVICE)
    weights = torch.randn(t.shape, generator=g).to(DEVICE)
    want = _out_and_grad(lambda x: _apply_rotary_pos_emb_bshd(x, freqs), t, weights)
    _check(_out_and_grad(lambda x: fusions.rope(x, freqs, kernels="triton"), t, weights), want, torch.float32)


@kernels_run
def test_rope_refuses_cos_that_does_not_fit():
    from mfsdp_kit.models.triton_fusions import rotate
    t = torch.randn(4, 1, 2, 8, device=DEVICE)
    for cos in (torch.rand(4, 1, 1, 10, device=DEVICE), torch.rand(3, 1, 1, 8, device=DEVICE)):   # too wide; 3 != 4
        with pytest.raises(ValueError, match="do not fit t"):
            rotate(t, cos, cos)


@kernels_run
def test_packed_rope_equals_megatron_unfused_thd():
    """Sequences of 5, 1 and 6 tokens end to end: positions restart at each."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd
    g = torch.Generator().manual_seed(1)
    t, freqs = torch.randn(12, 4, 16, generator=g).to(DEVICE), (torch.rand(6, 1, 1, 16, generator=g) * 6.28).to(DEVICE)
    cu = torch.tensor([0, 5, 6, 12], dtype=torch.int32, device=DEVICE)
    weights = torch.randn(t.shape, generator=g).to(DEVICE)
    want = _out_and_grad(lambda x: _apply_rotary_pos_emb_thd(x, cu, freqs, cp_group=ps.get_context_parallel_group()),
                         t, weights)
    _check(_out_and_grad(lambda x: fusions.rope_thd(x, cu, freqs, kernels="triton"), t, weights), want,
           torch.float32)


@kernels_run
def test_interleaved_rope_is_refused():
    t, freqs = torch.randn(4, 1, 2, 8, device=DEVICE), torch.rand(4, 1, 1, 8, device=DEVICE)
    with pytest.raises(NotImplementedError, match="interleaved"):
        fusions.rope(t, freqs, True, kernels="triton")


@kernels_run
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ffn", [24, 1500], ids=["small", "two-blocks"])
def test_swiglu_equals_silu_times_up(dtype, ffn):
    from mfsdp_kit.models.triton_fusions import swiglu
    g = torch.Generator().manual_seed(2)
    y = torch.randn(7, 3, 2 * ffn, generator=g).to(DEVICE, dtype)
    weights = torch.randn(7, 3, ffn, generator=g).to(DEVICE)

    def reference(x):
        gate, up = x.float().chunk(2, -1)
        return F.silu(gate) * up
    _check(_out_and_grad(swiglu, y, weights), _out_and_grad(reference, y, weights), dtype)


@kernels_run
def test_swiglu_patch_routes_only_what_the_kernels_compute(torch_slots_after):
    """After compat.apply("swiglu", kernel=) with the Triton kernel megatron's MLP sends bias-free calls to it and
    calls with a bias to megatron's own function; kernel=None ("torch") puts megatron's function back."""
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.transformer import mlp
    assert compat.apply("swiglu", kernel=fusions.swiglu_kernel("triton"))
    assert mlp.bias_swiglu_impl is not fused_bias_swiglu.bias_swiglu_impl
    y, bias = torch.randn(5, 1, 16, device=DEVICE, requires_grad=True), torch.randn(16, device=DEVICE)
    out = mlp.bias_swiglu_impl(y, None)
    assert out.grad_fn.name() == "_SwiGLUBackward"   # the Triton kernels' autograd node
    gate, up = y.detach().chunk(2, -1)
    torch.testing.assert_close(out, F.silu(gate) * up)
    with_bias = mlp.bias_swiglu_impl(y, bias)
    assert with_bias.grad_fn.name() != "_SwiGLUBackward"   # megatron's function
    gate, up = (y.detach() + bias).chunk(2, -1)
    torch.testing.assert_close(with_bias, F.silu(gate) * up)
    assert not compat.apply("swiglu", kernel=fusions.swiglu_kernel("torch"))
    assert mlp.bias_swiglu_impl is fused_bias_swiglu.bias_swiglu_impl


@kernels_run
def test_whole_gpt_loss_and_grads_match_unfused(torch_slots_after):
    """The kit's GPT, same seed and tokens: fused_kernels=True with fusion_kernels="triton" gives the unfused loss
    and grads, through the Triton kernels (megatron's slots hold them while the model runs)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import mlp
    from tests.models.gpt_grads import loss_and_grads

    def triton_paths(model):
        assert model.config.apply_rope_fusion and model.config.bias_activation_fusion
        assert rope_utils.fused_apply_rotary_pos_emb is fusions.ROPE_SLOTS["triton"][0]
        assert mlp.bias_swiglu_impl.__name__ == "_triton_bias_swiglu_impl"
    loss, grads = loss_and_grads(EngineConfig(kernels=Kernels(fused_kernels=False)))
    ours, our_grads = loss_and_grads(EngineConfig(kernels=Kernels(fused_kernels=True, fusion_kernels="triton")),
                                     check=triton_paths)
    assert (ours.mean() - loss.mean()).abs().item() < 1e-5
    assert (our_grads - grads).abs().max().item() < 1e-5


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match=re.escape("kernels.fusion_kernels='cuda' is not allowed; allowed: 'auto' | "
                                                    "'torch' | 'triton'")):
        EngineConfig(kernels=Kernels(fusion_kernels="cuda"))


def test_auto_is_triton_on_a_gpu_where_it_imports_and_torch_elsewhere(monkeypatch):
    """The default, "auto": the Triton kernels on a GPU where Triton imports, torch.compile's otherwise (on CPU even
    under Triton's interpreter, which is for tests that ask for "triton"); an explicit choice is kept."""
    assert Kernels().fusion_kernels == "auto"
    assert fusions.resolve_kernels("auto", on_gpu=True) == ("triton" if fusions.triton_runs(on_gpu=True) else "torch")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fusions.resolve_kernels("auto", on_gpu=False) == "torch"
    assert [fusions.resolve_kernels(k, on_gpu=False) for k in ("torch", "triton")] == ["torch", "triton"]


def test_triton_without_a_gpu_or_the_interpreter_is_refused_before_any_compat_change(monkeypatch):
    """On CPU without TRITON_INTERPRET (or without Triton at all), asking for the Triton kernels is a ConfigError
    naming the field, raised before megatron's slots change."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import mlp
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    slots = rope_utils.fused_apply_rotary_pos_emb, mlp.bias_swiglu_impl
    with pytest.raises(ConfigError, match="kernels.fusion_kernels='triton' is not allowed here"):
        fusions.transformer_settings(True, dict(activation_func=F.silu, gated_linear_unit=True), overrides={},
                                     on_gpu=False, kernels="triton")
    assert (rope_utils.fused_apply_rotary_pos_emb, mlp.bias_swiglu_impl) == slots
