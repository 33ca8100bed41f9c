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


@pytest.mark.parametrize("splits", [1, 2])
def test_skinny_gated_reads_silu_of_gate_times_up(splits):
    """`gated=True` on a fused gate/up output [M, 2K]: the product of SiLU(gate) * up, as `elementwise.gated`
    rounds it, with the down weight [N, K]."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    gate_up = torch.randn(7, 2 * 256, device=DEVICE, generator=gen)
    w = torch.randn(48, 256, device=DEVICE, generator=gen) / 16
    got = gemm.skinny(gate_up, w, gemm.GemmConfig(block_n=32, block_k=64, splits=splits), gated=True)
    got = got.sum(0) if splits > 1 else got
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(got, F.linear(F.silu(gate) * up, w), atol=1e-4, rtol=1e-4)


def test_down_config_keeps_one_wave_and_stays_out_past_max_rows():
    """tiny `l`'s down (2,048 x 8,192) splits K 4 ways on 132 multiprocessors and the 7 B shape's (3,584 x 18,944) 2
    ways, as bench/decode_gemm.py found best at 16-64 rows; cuBLAS past `MAX_ROWS` or where no config fits K."""
    for rows in (16, 64, 128):
        assert gemm.down_config(n=2048, k=8192, rows=rows, sms=132).splits == 4
        assert gemm.down_config(n=3584, k=18944, rows=rows, sms=132).splits == 2
    assert gemm.down_config(n=2048, k=8192, rows=gemm.MAX_ROWS + 1, sms=132) is None
    assert gemm.down_config(n=2048, k=96, rows=16, sms=132) is None
    config = gemm.down_config(n=3584, k=18944, rows=128, sms=132)
    assert config.fits(k=18944, rows=128) and config.stages < 5   # 128 rows: a shallower pipeline fits
