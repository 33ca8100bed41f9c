"""models.bucketed: packed rows grouped by length through dense causal SDPA equal one SDPA per sequence
(outputs and q/k/v gradients), on CPU in fp64 and on a GPU in bf16; the grouping is the cheapest split."""
import itertools

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from mfsdp_kit.models import bucketed
from mfsdp_kit.models.sdpa import per_sequence


def _params(lens):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                           max_seqlen_kv=max(lens))


def _padded_entries(groups, lens):
    return sum(len(g) * max(lens[i] for i in g) ** 2 for g in groups)


@pytest.mark.parametrize("lens", [[5, 300, 1, 77, 129, 290], [7], [3, 3, 3], [900, 16, 17, 500, 480, 30, 1]])
def test_groups_are_the_cheapest_split_of_the_sorted_lengths(lens):
    got = bucketed.groups(lens, max_groups=3)
    assert sorted(i for g in got for i in g) == list(range(len(lens))) and len(got) <= 3
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    best = min(_padded_entries([order[a:b] for a, b in zip((0, *cuts), (*cuts, len(lens)))], lens)
               for k in range(3) for cuts in itertools.combinations(range(1, len(lens)), k))
    assert _padded_entries(got, lens) == best


def _run(fn, q, k, v, weights):
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fn(*xs)
    (out.to(weights.dtype) * weights).sum().backward()
    return [out.detach()] + [x.grad for x in xs]


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("lens", [[300, 1, 77, 129, 5, 290], [1, 1, 1], [50] * 9 + [3]])
def test_grouped_row_equals_each_sequence_alone(lens, kv_heads):
    """fp64 on CPU: the same numbers as one SDPA per sequence to roundoff, grouped KV heads and 1-token
    sequences included."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens), 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(lens), kv_heads, 16, generator=g, dtype=torch.float64) for _ in range(2))
    weights = torch.randn(sum(lens), 4, 16, generator=g, dtype=torch.float64)
    params = _params(lens)
    got = _run(lambda q, k, v: bucketed.attention(q, k, v, params, causal=True, scale=0.25, dropout_p=0.0),
               q, k, v, weights)
    want = _run(lambda q, k, v: per_sequence(q, k, v, lens, causal=True, scale=0.25), q, k, v, weights)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert (a - b).abs().max().item() < 1e-12, name


def test_non_causal_is_refused():
    x = torch.zeros(4, 1, 8)
    with pytest.raises(NotImplementedError, match="causal"):
        bucketed.attention(x, x, x, _params([2, 2]), causal=False, scale=1.0, dropout_p=0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the dense GPU kernels run only on a GPU")
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_grouped_row_equals_each_sequence_alone_on_a_gpu(kv_heads):
    """bf16 on a GPU: grouped dense SDPA against per-sequence SDPA within bf16 rounding."""
    lens = [300, 1, 77, 129, 1000, 640]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(sum(lens), 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(sum(lens), kv_heads, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    weights = torch.randn(sum(lens), 8, 128, device="cuda", dtype=torch.float32, generator=g)
    params = _params(lens)
    got = _run(lambda q, k, v: bucketed.attention(q, k, v, params, causal=True, scale=128 ** -0.5, dropout_p=0.0),
               q, k, v, weights)
    want = _run(lambda q, k, v: per_sequence(q, k, v, lens, causal=True, scale=128 ** -0.5), q, k, v, weights)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = (a.float() - b.float()).abs().max().item()
        assert err < 2e-2 * max(1.0, b.float().abs().max().item()), (name, err)
