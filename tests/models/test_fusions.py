"""fused_kernels=True (compiled RoPE + megatron's fused SwiGLU) vs megatron's unfused path, fp32, one
gloo rank: same outputs, same grads. The compiled kernels come from torch.compile (C++ on CPU)."""
import pytest
import torch

from mfsdp_kit import compat
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import ConfigError, EngineConfig
from mfsdp_kit.models import GPTSpec, fusions
from tests.models.gpt_grads import loss_and_grads

TOL = 1e-5  # fp32: the compiled kernels round once where eager rounds after every op


@pytest.fixture(scope="module", autouse=True)
def world():
    from tests.dist.launch import free_port
    runtime.init(EngineConfig(), rank=0, world_size=1, master_port=free_port())
    yield
    runtime.shutdown()


@pytest.mark.parametrize("rot_dim", [16, 8], ids=["full", "partial"])
def test_rope_matches_megatron_unfused(rot_dim):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    g = torch.Generator().manual_seed(0)
    t = torch.randn(12, 2, 4, 16, generator=g)
    freqs = torch.rand(12, 1, 1, rot_dim, generator=g) * 6.28
    weights = torch.randn(t.shape, generator=g)  # a loss that sees every output
    outs, grads = [], []
    for fn in (_apply_rotary_pos_emb_bshd, fusions.rope):
        x = t.clone().requires_grad_()
        out = fn(x, freqs)
        (out * weights).sum().backward()
        outs.append(out.detach())
        grads.append(x.grad)
    assert (outs[0] - outs[1]).abs().max().item() < TOL
    assert (grads[0] - grads[1]).abs().max().item() < TOL
    if rot_dim < 16:  # the dims past rot_dim pass through untouched
        assert torch.equal(outs[1][..., rot_dim:], t[..., rot_dim:])


def test_packed_rope_matches_megatron_unfused_thd():
    """Sequences of 5, 1 and 6 tokens end to end: positions restart at each, as megatron's unfused thd RoPE."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd
    from megatron.core import parallel_state as ps
    g = torch.Generator().manual_seed(0)
    t, freqs = torch.randn(12, 4, 16, generator=g), torch.rand(6, 1, 1, 16, generator=g) * 6.28
    cu = torch.tensor([0, 5, 6, 12], dtype=torch.int32)
    weights = torch.randn(t.shape, generator=g)
    outs, grads = [], []
    for fn in (lambda x: _apply_rotary_pos_emb_thd(x, cu, freqs, cp_group=ps.get_context_parallel_group()),
               lambda x: fusions.rope_thd(x, cu, freqs)):
        x = t.clone().requires_grad_()
        out = fn(x)
        (out * weights).sum().backward()
        outs.append(out.detach())
        grads.append(x.grad)
    assert (outs[0] - outs[1]).abs().max().item() < TOL and (grads[0] - grads[1]).abs().max().item() < TOL
    at_zero = fusions.rope(t[5:6].unsqueeze(1), freqs[:1])[:, 0]
    assert (outs[1][5:6] - at_zero).abs().max().item() < TOL   # the 1-token sequence sits at position 0
    made = cu._mfsdp_rope   # every later layer's call on this row reuses the row's cos and sin ...
    assert torch.equal(fusions.rope_thd(t, cu, freqs), outs[1]) and cu._mfsdp_rope is made
    freqs.mul_(0.5)          # ... until its freqs change
    assert not torch.equal(fusions.rope_thd(t, cu, freqs), outs[1]) and cu._mfsdp_rope is not made


def test_rope_takes_cos_sin_once_per_freqs_and_again_after_an_in_place_change():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    g = torch.Generator().manual_seed(2)
    t, freqs = torch.randn(6, 1, 2, 8, generator=g), torch.rand(6, 1, 1, 8, generator=g) * 6.28
    fusions.rope(t, freqs)
    cos = freqs._mfsdp_cos_sin[1]
    fusions.rope(t, freqs)
    assert freqs._mfsdp_cos_sin[1] is cos   # the second call (another layer) reuses them
    freqs.mul_(0.5)                         # a changed angle is never served from the cache
    out = fusions.rope(t, freqs)
    assert freqs._mfsdp_cos_sin[1] is not cos
    assert (out - _apply_rotary_pos_emb_bshd(t, freqs)).abs().max().item() < TOL
    with torch.inference_mode():            # no version counter: made per call, nothing kept
        frozen = torch.rand(6, 1, 1, 8)
        assert (fusions.rope(t, frozen) - _apply_rotary_pos_emb_bshd(t, frozen)).abs().max().item() < TOL
    assert not hasattr(frozen, "_mfsdp_cos_sin")


def test_install_fills_only_the_empty_slot():
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.extensions.transformer_engine import HAVE_TE
    assert compat.apply("rope", slots=fusions.ROPE_SLOTS["torch"]) is (not HAVE_TE)
    assert (rope_utils.fused_apply_rotary_pos_emb is fusions.rope) is (not HAVE_TE)


def test_only_the_fusions_that_compute_the_same_apply():
    silu, gelu = torch.nn.functional.silu, torch.nn.functional.gelu
    settings = lambda **kw: fusions.transformer_settings(True, kw, overrides={}, on_gpu=False)  # noqa: E731
    assert fusions.transformer_settings(False, {}, overrides={}, on_gpu=True) == {}
    assert settings(activation_func=silu, gated_linear_unit=True) == dict(bias_activation_fusion=True,
                                                                           apply_rope_fusion=True)
    # megatron's fused GeGLU uses the tanh gelu: not the same function, so only RoPE is fused
    assert settings(activation_func=gelu, gated_linear_unit=True) == dict(apply_rope_fusion=True)
    assert settings(activation_func=silu, gated_linear_unit=True, rotary_interleaved=True) == dict(
        bias_activation_fusion=True)
    with pytest.raises(ConfigError, match="fused_kernels=True is not allowed.*gelu"):
        settings(activation_func=gelu, gated_linear_unit=False, multi_latent_attention=True)


def test_auto_fuses_what_applies_on_a_gpu_only():
    """The default ("auto"): nothing on CPU; on a GPU each fusion that applies, and no error when none does."""
    silu, gelu = torch.nn.functional.silu, torch.nn.functional.gelu
    auto = lambda on_gpu, **kw: fusions.transformer_settings("auto", kw, overrides={}, on_gpu=on_gpu)  # noqa: E731
    assert EngineConfig().kernels.fused_kernels == "auto"
    assert auto(False, activation_func=silu, gated_linear_unit=True) == {}
    assert auto(True, activation_func=silu, gated_linear_unit=True) == dict(bias_activation_fusion=True,
                                                                             apply_rope_fusion=True)
    assert auto(True, activation_func=gelu, gated_linear_unit=False, multi_latent_attention=True) == {}
    assert fusions.transformer_settings("auto", dict(activation_func=silu, gated_linear_unit=True), on_gpu=True,
                                        overrides=dict(apply_rope_fusion=False)) == dict(bias_activation_fusion=True)


def test_rope_compiles_once_per_layout_whatever_the_token_count():
    """Packed rows change their token count every micro-batch: the rotation's sizes are symbolic from its first
    compile, so new lengths and head counts reuse it. Two graphs per direction at most: q (contiguous) and k (a
    strided slice of megatron's fused qkv output), which dynamo guards apart by stride (a backward is no graph of
    its own here)."""
    from torch._dynamo.utils import counters
    g = torch.Generator().manual_seed(3)
    freqs = torch.rand(64, 1, 1, 16, generator=g) * 6.28
    before = counters["stats"]["unique_graphs"]
    for tokens in (50, 41, 23):
        mixed = torch.randn(tokens, 1, 2, 6 * 16, generator=g, requires_grad=True)   # 2 groups: 4 q heads, k, v
        q = mixed[..., :64].reshape(tokens, 1, 8, 16)
        k = mixed[..., 64:80]
        out = fusions.rope(q, freqs[:tokens]).sum() + fusions.rope(k, freqs[:tokens]).sum()
        out.backward()
    assert counters["stats"]["unique_graphs"] - before <= 2, counters["stats"]["unique_graphs"] - before


def test_explicit_override_wins():
    from mfsdp_kit.models import transformer_config
    cfg = EngineConfig(fused_kernels=True, override_transformer_config=dict(apply_rope_fusion=False))
    config = transformer_config(GPTSpec(hidden_size=64, num_attention_heads=4), cfg)
    assert config.bias_activation_fusion and not config.apply_rope_fusion


def test_whole_gpt_loss_and_grads_match_unfused():
    """The kit's GPT, same seed and tokens: fused_kernels=True gives the unfused loss and grads, and
    really runs the fused paths (megatron's flags are set in the model's config)."""
    def fused_paths(model, fused):
        assert model.config.apply_rope_fusion is fused and model.config.bias_activation_fusion is fused
    runs = {fused: loss_and_grads(EngineConfig(fused_kernels=fused), check=lambda m, f=fused: fused_paths(m, f))
            for fused in (False, True)}
    (loss, grads), (fused_loss, fused_grads) = runs[False], runs[True]
    print("loss |diff|", (fused_loss.mean() - loss.mean()).abs().item(), "grad max|diff|",
          (grads - fused_grads).abs().max().item())
    assert (fused_loss.mean() - loss.mean()).abs().item() < TOL
    assert (grads - fused_grads).abs().max().item() < TOL


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match="fused_kernels"):
        EngineConfig(fused_kernels="yes")   # refused when made


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_hf_model_logits_match_transformers(arch, tmp_path):
    """The Megatron-Bridge path: a tiny HF folder loaded with fused_kernels=True gives transformers' logits."""
    import transformers
    from mfsdp_kit.train.generate import logits
    from mfsdp_kit.models.hf import load
    from mfsdp_kit.models.tiny import tiny
    src = tiny(tmp_path / arch, arch=arch, size="xs", seed=1)
    model = load(src, EngineConfig(fused_kernels=True))
    assert model.config.apply_rope_fusion and model.config.bias_activation_fusion
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tokens = torch.randint(0, hf.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    ours = logits(model.chunks, tokens, vocab_size=hf.config.vocab_size)
    with torch.no_grad():
        theirs = hf(tokens).logits
    engine.release(model.chunks)
    assert (ours - theirs).abs().max().item() < TOL


def test_megatron_swiglu_compiles_once_whatever_the_token_count():
    """megatron's own fusions (its `jit_fuser`, compiled lazily by `compat.patches.lazy_compile`) take symbolic sizes from
    the first compile too: the forward and the backward function, one graph each, for three token counts."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    from torch._dynamo.utils import counters
    g = torch.Generator().manual_seed(4)
    before = counters["stats"]["unique_graphs"]
    for tokens in (37, 29, 11):
        y = torch.randn(tokens, 1, 2 * 24, generator=g, requires_grad=True)
        bias_swiglu_impl(y, None).sum().backward()
    assert counters["stats"]["unique_graphs"] - before <= 2, counters["stats"]["unique_graphs"] - before
