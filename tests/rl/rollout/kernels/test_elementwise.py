"""rl.rollout.kernels.elementwise: each Triton kernel equals the torch function it replaces (`decoder.rope_store`,
`add_rms`, `gated`), on strided q/k/v views of a fused q/k/v output as the decoder passes them, in fp32 and bf16, for
head sizes that are and are not powers of two; and a whole decode step with the kernels equals the torch step. On a
GPU, or on CPU in Triton's interpreter (fp32 only; tests/rl/rollout/kernels/test_attention.py says how)."""
import os

import pytest
import torch

from mfsdp_kit.rl.rollout import decoder
from mfsdp_kit.rl.rollout.kernels import elementwise
from mfsdp_kit.rl.rollout.kernels.attention import triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(triton is None or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
                                reason="the kernels run on a GPU (Triton), or on CPU in Triton's interpreter")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(16, 4, 128), (6, 2, 80), (4, 4, 64)])
def test_rope_store_equals_the_torch_function(dtype, heads, kv_heads, dim):
    b, rows, slots = 24, 32, 48
    qkv = torch.randn(b, (heads + 2 * kv_heads) * dim, device=DEVICE, dtype=dtype)
    q, k, v = (t.reshape(b, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    angles = torch.randn(b, 1, dim // 2, device=DEVICE)
    cos, sin = (f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin))
    pos = torch.randint(0, slots, (b,), device=DEVICE)
    where = ((torch.arange(b, device=DEVICE)[:, None] * kv_heads + torch.arange(kv_heads, device=DEVICE)) * slots
             + pos[:, None]).flatten()
    caches = [[torch.zeros(rows, kv_heads, slots, dim, device=DEVICE, dtype=dtype) for _ in range(2)]
              for _ in range(2)]
    outs = [fn(q, k, v, cos, sin, kc.view(-1, dim), vc.view(-1, dim), where)
            for fn, (kc, vc) in zip((decoder.rope_store, elementwise.rope_store), caches)]
    assert outs[1].shape == outs[0].shape == (b, heads, 1, dim)
    torch.testing.assert_close(outs[1], outs[0], **TOL[dtype])
    for ours, want in zip(caches[1], caches[0]):
        torch.testing.assert_close(ours, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [2048, 3584, 96])
def test_add_rms_and_gated_equal_the_torch_functions(dtype, hidden):
    x, delta = (torch.randn(40, hidden, device=DEVICE, dtype=dtype) for _ in range(2))
    weight = torch.rand(hidden, device=DEVICE, dtype=dtype) + 0.5
    for ours, want in zip(elementwise.add_rms(x, delta, weight, 1e-6), decoder.add_rms(x, delta, weight, 1e-6)):
        torch.testing.assert_close(ours, want, **TOL[dtype])
    gate_up = torch.randn(40, 2 * hidden, device=DEVICE, dtype=dtype)
    torch.testing.assert_close(elementwise.gated(gate_up), decoder.gated(gate_up, torch.nn.SiLU()), **TOL[dtype])


@pytest.mark.parametrize("window", [None, 5])
def test_a_decode_step_with_the_kernels_equals_the_torch_step(window, tmp_path):
    """`decoder.decode` of a tiny Qwen2 (written by transformers) with the Triton glue and attention against the torch
    functions: the same hidden states and the same K/V written, rows at different positions, fp32; with `window`,
    every other layer attends to its last `window` slots."""
    from transformers import AutoModelForCausalLM
    from mfsdp_kit.models.archs import write_tiny
    model = AutoModelForCausalLM.from_pretrained(write_tiny("Qwen2ForCausalLM", tmp_path / "q"),
                                                 dtype=torch.float32).to(DEVICE)
    decoder.fuse_projections(model)
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    gen = torch.Generator().manual_seed(0)
    kv = [tuple(torch.randn(6, c.num_key_value_heads, 64, head_dim, generator=gen).to(DEVICE) for _ in range(2))
          for _ in model.model.layers]
    rope = decoder.rope_table(model, slots=64, like=kv[0][0])
    tok, pos = torch.tensor([5, 9, 31, 2, 70], device=DEVICE), torch.tensor([0, 7, 63, 20, 41], device=DEVICE)
    outs = []
    for glue in (decoder.EAGER, decoder.Glue(mode="triton")):
        cache = [(k.clone(), v.clone()) for k, v in kv]
        with torch.no_grad():
            h = decoder.decode(model, tok, pos, cache, rope, slots=64, head_dim=head_dim, clip_qkv=None, glue=glue,
                               windows=[window if i % 2 else None for i in range(len(cache))])
        outs.append((h, cache))
    (want, want_cache), (got, got_cache) = outs
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for (k1, v1), (k0, v0) in zip(got_cache, want_cache):
        torch.testing.assert_close(k1, k0, **TOL[torch.float32])
        torch.testing.assert_close(v1, v0, **TOL[torch.float32])
