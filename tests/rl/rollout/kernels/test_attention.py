"""rl.rollout.kernels.attention: the Triton decode kernels equal SDPA over the masked slot bucket (each row up to its
own position, a sliding window's start, query groups of 1 to 8 heads, head sizes that are and are not powers of two,
one split or many), inside a CUDA graph too; and the engine decodes with them (`DecodeConfig.kernels="triton"`) the
tokens it decodes with SDPA.

On a GPU these run with Triton; on CPU they run in Triton's interpreter when asked (triton >= 3.9 installed,
`TRITON_INTERPRET=1 pytest tests/rl/rollout/kernels/test_attention.py tests/rl/rollout/kernels/test_elementwise.py`,
fp32 only), else they skip: CI installs no Triton."""
import os

import pytest
import torch
import torch.nn.functional as F

from mfsdp_kit.rl.rollout import decoder
from mfsdp_kit.rl.rollout.kernels import attention
from mfsdp_kit.rl.rollout.decoder import masks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
kernels = pytest.mark.skipif(attention.triton is None or (DEVICE == "cpu" and not INTERPRETED),
                             reason="the kernels run on a GPU (Triton), or on CPU in Triton's interpreter")
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and attention.triton is not None),
                         reason="CUDA graphs and the engine's GPU path")
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
TOL = dict(atol=2e-2, rtol=2e-2) if DTYPE == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)


def sdpa(q, k, v, pos, *, slots, window, scale):
    bias = masks(pos, slots=slots, windows=[window], dtype=q.dtype)[window]
    b = q.shape[0]
    return F.scaled_dot_product_attention(q[:, :, None], k[:b, :, :slots], v[:b, :, :slots], attn_mask=bias,
                                          enable_gqa=True, scale=scale)[:, :, 0]


def test_splits_fill_the_device_at_small_batch_and_stay_whole_at_large():
    assert attention.splits_for(programs=16 * 4, slots=576, sms=132) == 5
    assert attention.splits_for(programs=512 * 4, slots=576, sms=132) == 1
    assert attention.splits_for(programs=2, slots=64, sms=132) == 1   # never a split under BLOCK_N keys


@kernels
@pytest.mark.parametrize("heads,kv_heads,dim", [(16, 4, 128), (8, 8, 64), (8, 1, 80), (12, 2, 96)])
@pytest.mark.parametrize("window", [None, 40])
def test_kernels_equal_sdpa_over_the_masked_bucket(heads, kv_heads, dim, window):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    shapes = [(40, 33, 192), (512, 512, 128), (16, 3, 576)] if DEVICE == "cuda" else [(8, 5, 192), (4, 3, 320)]
    for rows, b, slots in shapes:
        k, v = (torch.randn(rows, kv_heads, 640, dim, device=DEVICE, dtype=DTYPE, generator=gen) for _ in range(2))
        q = torch.randn(b, heads, dim, device=DEVICE, dtype=DTYPE, generator=gen)
        pos = torch.randint(0, slots, (b,), device=DEVICE, generator=gen)
        pos[0], pos[-1] = slots - 1, 0
        got = attention.decode_attention(q, k, v, pos, slots=slots, window=window, scale=dim ** -0.5)
        want = sdpa(q, k, v, pos, slots=slots, window=window, scale=dim ** -0.5)
        assert got.shape == want.shape and got.dtype == DTYPE
        torch.testing.assert_close(got.float(), want.float(), **TOL)


@kernels
@pytest.mark.parametrize("heads,kv_heads,dim", [(16, 4, 128), (8, 8, 64), (8, 1, 80), (12, 2, 96)])
@pytest.mark.parametrize("window", [None, 40, 200])
def test_fused_rope_equals_rope_store_then_the_kernels(heads, kv_heads, dim, window):
    """`new` (`DecodeConfig.fuse_rope`): q and k rotated, k and v written at each row's position, attended to, in one
    launch: the same output and the same cache as `elementwise.rope_store` then the kernels, with q, k, v strided views
    of one q/k/v GEMM output; positions at the last slot, at 0 and on and beside the splits' edges (64, 127, 128);
    a window shorter than a share and one longer (a later split then holds the position)."""
    from mfsdp_kit.rl.rollout.kernels import elementwise
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    shapes = [(40, 33, 192), (16, 5, 576)] if DEVICE == "cuda" else [(8, 5, 192), (4, 3, 320)]
    for rows, b, slots in shapes:
        cache = [torch.randn(rows, kv_heads, 640, dim, device=DEVICE, dtype=DTYPE, generator=gen) for _ in range(2)]
        fused = torch.randn(b, (heads + 2 * kv_heads) * dim, device=DEVICE, dtype=DTYPE, generator=gen)
        q, k, v = (t.unflatten(-1, (-1, dim)) for t in fused.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
        angle = torch.rand(b, dim // 2, device=DEVICE, generator=gen, dtype=torch.float32) * 6.3
        cos, sin = (f(torch.cat([angle, angle], -1)).to(DTYPE)[:, None] for f in (torch.cos, torch.sin))
        pos = torch.randint(0, slots, (b,), device=DEVICE, generator=gen)
        pos[0], pos[-1] = slots - 1, 0
        edges = torch.tensor([64, 127, 128], device=DEVICE)[:b - 2]
        pos[1:1 + len(edges)] = edges
        ref = [c.clone() for c in cache]
        where = ((torch.arange(b, device=DEVICE)[:, None] * kv_heads + torch.arange(kv_heads, device=DEVICE)) * 640
                 + pos[:, None]).flatten()
        q_rot = elementwise.rope_store(q, k, v, cos, sin, ref[0].view(-1, dim), ref[1].view(-1, dim), where)[:, :, 0]
        want = attention.decode_attention(q_rot, *ref, pos, slots=slots, window=window, scale=dim ** -0.5)
        got = attention.decode_attention(q, *cache, pos, slots=slots, window=window, scale=dim ** -0.5,
                                         new=(k, v, cos[:, 0], sin[:, 0]))
        torch.testing.assert_close(got.float(), want.float(), **TOL)
        for mine, theirs in zip(cache, ref):   # the same fp32 rotation, one rounding: equal but for FMA contraction
            torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=8e-3 if DTYPE == torch.bfloat16 else 1e-6)


@gpu
def test_kernels_replay_in_a_cuda_graph_with_new_positions():
    k, v = (torch.randn(64, 4, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(64, 16, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.zeros(64, dtype=torch.long, device="cuda")
    attention.decode_attention(q, k, v, pos, slots=256, window=None, scale=0.1)   # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention.decode_attention(q, k, v, pos, slots=256, window=None, scale=0.1)
    for step in (5, 200):
        pos.copy_(torch.randint(0, step + 1, (64,), device="cuda"))
        graph.replay()
        torch.testing.assert_close(out.float(), sdpa(q, k, v, pos, slots=256, window=None, scale=0.1).float(),
                                   atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("fuse_rope", [False, True])
def test_the_engine_decodes_with_the_kernels_when_asked_on_a_gpu(fuse_rope, tmp_path):
    """Greedy tokens of an fp32 engine with the kernels (fp32 products, no TF32; with `fuse_rope`, RoPE and the cache
    write inside attention) equal those of the same engine on SDPA and compiled glue (`kernels="torch"`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from mfsdp_kit.models.archs import write_tiny
    from mfsdp_kit.rl.rollout import ContinuousRollout, DecodeConfig
    folder = write_tiny("Qwen2ForCausalLM", tmp_path / "qwen2")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda()
    tok = AutoTokenizer.from_pretrained(folder)
    rows = [[(7 * i + j) % 200 + 3 for j in range(3 + i % 9)] for i in range(40)]
    kw = dict(max_new_tokens=60, temperature=0, top_p=1.0, seed=0)
    fast = ContinuousRollout(model, tok, config=DecodeConfig(check_every=4, slot_bucket=16, kernels="triton",
                                                             fuse_rope=fuse_rope))
    tokens = fast.generate(rows, **kw)[0]
    assert fast.runner.glue(True).mode == "triton" and fast.runner.glue(True).fuse_rope == fuse_rope
    plain = ContinuousRollout(model, tok, config=DecodeConfig(check_every=4, slot_bucket=16, kernels="torch"))
    assert plain.generate(rows, **kw)[0] == tokens and plain.runner.glue(True).mode == "compiled"


@pytest.mark.skipif(attention.triton is None or not (DEVICE == "cpu" and INTERPRETED),
                    reason="CPU, in Triton's interpreter (on a GPU: the test above)")
@pytest.mark.parametrize("fuse_rope", [False, True])
def test_the_engine_decodes_through_the_kernels_as_transformers_generate(fuse_rope, tmp_path, monkeypatch):
    """The engine's decode steps through the Triton glue and attention (forced here, as `kernels="triton"` asks on a
    GPU; with `fuse_rope`, RoPE and the cache write inside attention), fp32, rows refilled and moved: greedy tokens
    equal transformers' `generate`."""
    from tests.rl.rollout.test_engine import ROWS, SMALL, hf_greedy, load
    from mfsdp_kit.rl.rollout import ContinuousRollout
    model, tok = load("Qwen2ForCausalLM", tmp_path)
    kit = ContinuousRollout(model, tok, config=SMALL)
    glue = decoder.Glue(mode="triton", fuse_rope=fuse_rope)
    monkeypatch.setattr(kit.runner, "glue", lambda gpu: glue)
    assert kit.generate(ROWS * 2, max_new_tokens=12, temperature=0, top_p=1.0, seed=0)[0] == \
        hf_greedy(model, tok, ROWS * 2, 12)
