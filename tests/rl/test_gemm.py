"""rl.rollout.gemm: the skinny Triton GEMM equals `F.linear` for batches that are and are not powers of two, with one
split (the product in x's dtype) and with several (fp32 partial sums), and refuses a K it cannot split. On a GPU, or
on CPU in Triton's interpreter (fp32 only; tests/rl/test_attention.py says how)."""
import os

import pytest
import torch
import torch.nn.functional as F

from mfsdp_kit.rl.rollout import gemm
from mfsdp_kit.rl.rollout.attention import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(triton is None or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
                                reason="the kernel runs on a GPU (Triton), or on CPU in Triton's interpreter")
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k,config", [
    (5, 96, 256, gemm.GemmConfig(block_n=32, block_k=64, splits=2)),
    (16, 128, 128, gemm.GemmConfig(block_n=64, block_k=128)),
    (33, 100, 512, gemm.GemmConfig(block_n=32, block_k=64, splits=4, stages=3)),
])
def test_skinny_equals_f_linear(dtype, rows, n, k, config):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(rows, k, device=DEVICE, dtype=dtype, generator=gen)
    w = torch.randn(n, k, device=DEVICE, dtype=dtype, generator=gen) / k ** 0.5
    got = gemm.skinny(x, w, config)
    if config.splits == 1:
        assert got.shape == (rows, n) and got.dtype == dtype
    else:
        assert got.shape == (config.splits, rows, n) and got.dtype == torch.float32
        got = got.sum(0)
    want = F.linear(x.float(), w.float())
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)


def test_skinny_refuses_a_k_it_cannot_split():
    x, w = torch.zeros(4, 96, device=DEVICE), torch.zeros(32, 96, device=DEVICE)
    with pytest.raises(ValueError, match="K=96"):
        gemm.skinny(x, w, gemm.GemmConfig(block_n=32, block_k=64))
