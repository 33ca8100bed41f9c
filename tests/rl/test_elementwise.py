"""rl.rollout.elementwise: each Triton kernel equals the torch function it replaces (`decoder.rope_store`, `add_rms`,
`gated`), on strided q/k/v views of a fused q/k/v output as the decoder passes them, in fp32 and bf16, for head sizes
that are and are not powers of two."""
import pytest
import torch

from mfsdp_kit.rl.rollout import decoder, elementwise
from mfsdp_kit.rl.rollout.attention import triton

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and triton is not None),
                                reason="the kernels run on a GPU (Triton)")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(16, 4, 128), (6, 2, 80), (4, 4, 64)])
def test_rope_store_equals_the_torch_function(dtype, heads, kv_heads, dim):
    b, rows, slots = 24, 32, 48
    qkv = torch.randn(b, (heads + 2 * kv_heads) * dim, device="cuda", dtype=dtype)
    q, k, v = (t.reshape(b, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    angles = torch.randn(b, 1, dim // 2, device="cuda")
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin))
    pos = torch.randint(0, slots, (b,), device="cuda")
    where = ((torch.arange(b, device="cuda")[:, None] * kv_heads + torch.arange(kv_heads, device="cuda")) * slots
             + pos[:, None]).flatten()
    caches = [[torch.zeros(rows, kv_heads, slots, dim, device="cuda", dtype=dtype) for _ in range(2)]
              for _ in range(2)]
    outs = [fn(q, k, v, cos, sin, kc.view(-1, dim), vc.view(-1, dim), where)
            for fn, (kc, vc) in zip((decoder.rope_store, elementwise.rope_store), caches)]
    assert outs[1].shape == outs[0].shape == (b, heads, 1, dim)
    torch.testing.assert_close(outs[1], outs[0], **TOL[dtype])
    for ours, want in zip(caches[1], caches[0]):
        torch.testing.assert_close(ours, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [2048, 3584, 96])
def test_add_rms_and_gated_equal_the_torch_functions(dtype, hidden):
    x, delta = (torch.randn(40, hidden, device="cuda", dtype=dtype) for _ in range(2))
    weight = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5
    for ours, want in zip(elementwise.add_rms(x, delta, weight, 1e-6), decoder.add_rms(x, delta, weight, 1e-6)):
        torch.testing.assert_close(ours, want, **TOL[dtype])
    gate_up = torch.randn(40, 2 * hidden, device="cuda", dtype=dtype)
    torch.testing.assert_close(elementwise.gated(gate_up), decoder.gated(gate_up, torch.nn.SiLU()), **TOL[dtype])
