"""rl.rollout.kernels.fp8: per-channel e4m3 quantization stays within e4m3's rounding bound (random rows of very
different magnitudes, and a tiny model's real projection weights), zero rows are safe, each row's amax lands on 448,
and the reference GEMM stays near the plain one. On a GPU of sm89+: the Triton row quantizer equals its torch twin
and `scaled_linear` (`torch._scaled_mm`, row-wise scales) equals the reference."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from mfsdp_kit.models.archs import write_tiny
from mfsdp_kit.rl.rollout.kernels import fp8

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def within_e4m3(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """|q * scale - w| <= max(2^-4 |w|, 2^-10 scale): e4m3 keeps 3 mantissa bits (half a step: 2^-4 of the value),
    and below its smallest normal (2^-6) its subnormals are 2^-9 apart (half: 2^-10), in units of the row's scale."""
    err = (q.float() * scale - w.float()).abs()
    bound = torch.maximum(w.float().abs() * 2 ** -4, scale * 2 ** -10) * (1 + 1e-6)
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_within_e4m3s_bound_on_random_rows(dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 256, generator=g) * torch.logspace(-4, 3, 96)[:, None]).to(dtype)   # 7 decades of rows
    q, scale = fp8.quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (96, 1) and scale.dtype == torch.float32
    within_e4m3(w, q, scale)
    assert torch.equal(q.float().abs().amax(-1), torch.full((96,), 448.0))   # each row's amax on e4m3's largest


def test_round_trip_within_e4m3s_bound_on_a_tiny_models_projections(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(write_tiny("Qwen2ForCausalLM", tmp_path / "m"), dtype=torch.bfloat16)
    names = [n for n, p in model.named_parameters() if n.endswith("proj.weight")]
    assert len(names) == 7 * model.config.num_hidden_layers
    for name in names:
        w = model.get_parameter(name).detach()
        within_e4m3(w, *fp8.quantize_rows(w))


def test_zero_rows_and_columns_are_safe():
    w = torch.randn(32, 64)
    w[3], w[:, 5] = 0, 0
    q, scale = fp8.quantize_rows(w)
    assert scale[3].item() == 1.0 and not q[3].float().any() and not q[:, 5].float().any()
    assert torch.isfinite(q.float()).all() and torch.isfinite(scale).all()
    within_e4m3(w, q, scale)


def test_reference_gemm_is_near_the_plain_one():
    """Two e4m3 roundings (weight and activation) of 2^-4 at most each: the GEMM's error is a few percent of the
    output's scale, far less on average."""
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(5, 3, 128, generator=g), torch.randn(64, 128, generator=g) / 11, torch.randn(64, generator=g)
    q, scale = fp8.quantize_rows(w)
    out, want = fp8.dequantized_linear(x, q, scale.reshape(1, -1), b), torch.nn.functional.linear(x, w, b)
    assert out.shape == want.shape == (5, 3, 64)
    rel = (out - want).norm() / want.norm()
    assert rel < 0.03, rel
    assert fp8.fits(w) and not fp8.fits(torch.empty(64, 120))


gpu = pytest.mark.skipif(not FP8_GPU, reason="FP8 GEMMs: a CUDA GPU of compute capability 8.9+")


@gpu
@pytest.mark.parametrize("k", [64, 3584, 18944])   # one pass, and widths over BLOCK_MAX (the kernel's two loops)
def test_the_triton_quantizer_equals_its_torch_twin(k):
    x = torch.randn(37, k, device="cuda", dtype=torch.bfloat16) * torch.logspace(-3, 2, 37, device="cuda")[:, None]
    x[5] = 0
    (q, s), (q_ref, s_ref) = fp8.quantize_rows_kernel(x), fp8.quantize_rows(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=0.07, atol=0)   # at most one e4m3 step apart
    assert (q.float() == q_ref.float()).float().mean() > 0.99


@gpu
@pytest.mark.parametrize("kernel", [True, False])
def test_scaled_linear_equals_the_reference(kernel):
    x = torch.randn(2, 24, 512, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(384, 512, device="cuda") / 20).to(torch.bfloat16)
    b = torch.randn(384, device="cuda", dtype=torch.bfloat16)
    q, scale = fp8.quantize_rows(w)
    out = fp8.scaled_linear(x, q, scale.reshape(1, -1).contiguous(), b, kernel=kernel)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 24, 384)
    torch.testing.assert_close(out, fp8.dequantized_linear(x, q, scale.reshape(1, -1), b), atol=2e-2, rtol=2e-2)
