"""models.varlen: the varlen flash kernel on packed rows equals one SDPA per sequence (GPU), and is not
chosen where it cannot run (CPU, fp32)."""
import pytest
import torch
import torch.nn.functional as F

from mfsdp_kit.models import varlen


def test_not_usable_on_cpu_or_in_fp32():
    assert not varlen.usable(torch.zeros(4, 2, 64, dtype=torch.bfloat16))
    if torch.cuda.is_available():
        assert not varlen.usable(torch.zeros(4, 2, 64, device="cuda"))
        assert not varlen.usable(torch.zeros(4, 2, 12, device="cuda", dtype=torch.bfloat16))
        assert varlen.usable(torch.zeros(4, 2, 64, device="cuda", dtype=torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the varlen flash kernel runs only on a GPU")
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_packed_row_equals_each_sequence_alone_on_a_gpu(kv_heads):
    """Sequences of 300, 1, 77 and 129 tokens end to end, 8 query heads: outputs and q/k/v grads of one varlen
    call equal per-sequence SDPA's (bf16, both fused kernels)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    lens, heads, hn = [300, 1, 77, 129], 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(sum(lens), h, hn, device="cuda", dtype=torch.bfloat16, generator=g)
               for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                             max_seqlen_kv=max(lens))
    weights = torch.randn(sum(lens), heads, hn, device="cuda", dtype=torch.bfloat16, generator=g)

    def run(fn):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*xs)
        (out.float() * weights).sum().backward()
        return [out.detach()] + [x.grad for x in xs]

    def each(q, k, v):
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            s = [x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
            outs.append(F.scaled_dot_product_attention(*s, is_causal=True, enable_gqa=kv_heads < heads)[0].transpose(0, 1))
        return torch.cat(outs)
    packed = run(lambda q, k, v: varlen.attention(q, k, v, params, causal=True, scale=hn ** -0.5, dropout_p=0.0))
    for name, a, b in zip(("out", "dq", "dk", "dv"), packed, run(each)):
        err = (a.float() - b.float()).abs().max().item()
        print(name, err)
        assert err < 2e-2 * max(1.0, b.float().abs().max().item()), name   # bf16 rounding, two kernels
