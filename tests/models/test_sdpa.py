"""SDPAttention vs megatron's DotProductAttention on one gloo rank, fp32: same outputs and grads."""
import pytest
import torch

from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import EngineConfig
from mfsdp_kit.models import GPTSpec, gpt_model_fn
from mfsdp_kit.models.gpt import transformer_config

TOL = 1e-5  # fp32 rounding: the two compute the same sums in different orders


@pytest.fixture(scope="module", autouse=True)
def world():
    from tests.dist.launch import free_port
    runtime.init(EngineConfig(), rank=0, world_size=1, master_port=free_port())
    yield
    runtime.shutdown()


def _pair(spec: GPTSpec, **overrides):
    """(megatron DotProductAttention, SDPAttention) built from the same config."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from mfsdp_kit.models.sdpa import SDPAttention
    config = transformer_config(spec, EngineConfig(override_transformer_config=overrides))
    kw = dict(config=config, layer_number=3, attn_mask_type=AttnMaskType.causal, attention_type="self",
              softmax_scale=config.softmax_scale)
    return DotProductAttention(**kw), SDPAttention(**kw), config


def _qkv(config, sq=16, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    hn, groups = config.kv_channels, config.num_query_groups
    q = torch.randn(sq, b, config.num_attention_heads, hn, generator=g, requires_grad=True)
    k = torch.randn(sq, b, groups, hn, generator=g, requires_grad=True)
    v = torch.randn(sq, b, groups, hn, generator=g, requires_grad=True)
    return q, k, v


def _run(module, q, k, v, mask=None):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = module(q, k, v, mask)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)  # a loss that sees every output
    (out * weights).sum().backward()
    return out.detach(), [x.grad for x in (q, k, v)]


def _assert_same(ref, new):
    (ref_out, ref_grads), (out, grads) = ref, new
    assert out.shape == ref_out.shape
    diffs = [(out - ref_out).abs().max().item()] + [(g - r).abs().max().item() for g, r in zip(grads, ref_grads)]
    print("max|diff| out, dq, dk, dv:", diffs)
    assert max(diffs) < TOL


CASES = {
    "mha": dict(num_attention_heads=4, num_query_groups=None),
    "gqa": dict(num_attention_heads=8, num_query_groups=2),
}


@pytest.mark.parametrize("heads", CASES.values(), ids=CASES.keys())
def test_causal_matches_dot_product_attention(heads):
    ref, sdpa, config = _pair(GPTSpec(hidden_size=64, **heads))
    q, k, v = _qkv(config)
    _assert_same(_run(ref, q, k, v), _run(sdpa, q, k, v))


@pytest.mark.parametrize("heads", CASES.values(), ids=CASES.keys())
def test_explicit_mask_matches(heads):
    """megatron's bool mask (True = masked out), [b, 1, sq, sk]: causal plus per-sequence padding."""
    ref, sdpa, config = _pair(GPTSpec(hidden_size=64, **heads))
    q, k, v = _qkv(config, sq=12, b=2)
    mask = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1).expand(2, 1, 12, 12).clone()
    mask[1, :, :, 9:] = True  # sequence 1: last 3 keys are padding
    mask[1, :, 9:, :] = False  # ...and their query rows see the prefix (no fully masked rows)
    mask[1, :, 9:, 9:] = True
    _assert_same(_run(ref, q, k, v, mask), _run(sdpa, q, k, v, mask))


def test_query_key_layer_scaling_and_explicit_scale():
    """apply_query_key_layer_scaling leaves the net scale 1/sqrt(hn); softmax_scale overrides it."""
    for overrides in (dict(apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True),
                      dict(softmax_scale=0.05)):
        ref, sdpa, config = _pair(GPTSpec(hidden_size=64, num_attention_heads=4), **overrides)
        q, k, v = _qkv(config)
        _assert_same(_run(ref, q, k, v), _run(sdpa, q, k, v))


def test_unsupported_features_are_named():
    _, sdpa, config = _pair(GPTSpec(hidden_size=64, num_attention_heads=4))
    q, k, v = _qkv(config)
    from megatron.core.packed_seq_params import PackedSeqParams
    with pytest.raises(NotImplementedError, match="packed sequences as 'sbhd'"):
        sdpa(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    with pytest.raises(NotImplementedError, match="attention_bias"):
        sdpa(q, k, v, None, attention_bias=torch.zeros(1))
    with pytest.raises(NotImplementedError, match="sliding-window"):
        _pair(GPTSpec(hidden_size=64, num_attention_heads=4), window_size=(4, 0))


@pytest.mark.parametrize("heads", CASES.values(), ids=CASES.keys())
def test_packed_sequences_match_each_sequence_alone(heads):
    """Sequences of 5, 1, 9 and 3 tokens end to end ("thd"): each sequence's outputs and grads are those of
    megatron's attention on that sequence alone - no token sees another sequence."""
    from megatron.core.packed_seq_params import PackedSeqParams
    ref, sdpa, config = _pair(GPTSpec(hidden_size=64, **heads))
    lens = [5, 1, 9, 3]
    q, k, v = (x[:, 0] for x in _qkv(config, sq=sum(lens), b=1))   # [t, heads, hn]
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    packed = _run(lambda *a: sdpa(*a, packed_seq_params=params), q, k, v)
    weights = torch.linspace(-1, 1, packed[0].numel()).reshape(packed[0].shape)   # _run's loss, split by sequence
    outs, grads = [], [torch.zeros_like(x) for x in (q, k, v)]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        xs = [x.detach()[a:b].unsqueeze(1).clone().requires_grad_() for x in (q, k, v)]   # [L, b=1, heads, hn]
        out = ref(*xs, None)[:, 0]
        (out * weights[a:b]).sum().backward()
        outs.append(out.detach())
        for g, x in zip(grads, xs):
            g[a:b] = x.grad[:, 0]
    _assert_same((torch.cat(outs), grads), packed)


def test_dropout_only_in_training():
    _, sdpa, config = _pair(GPTSpec(hidden_size=64, num_attention_heads=4), attention_dropout=0.5)
    q, k, v = _qkv(config)
    sdpa.eval()
    assert torch.equal(sdpa(q, k, v, None), sdpa(q, k, v, None))
    sdpa.train()
    assert not torch.equal(sdpa(q, k, v, None), sdpa(q, k, v, None))


@pytest.mark.parametrize("heads", CASES.values(), ids=CASES.keys())
def test_whole_gpt_loss_matches_local(heads):
    """The kit's GPT, same seed and tokens: attention_backend="sdpa" gives the "local" loss."""
    spec = GPTSpec(hidden_size=64, **heads)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_len_tokens + 1), generator=g)
    pos = torch.arange(spec.seq_len_tokens).unsqueeze(0).expand(2, -1)
    losses, grads = {}, {}
    for backend in ("local", "sdpa"):
        cfg = EngineConfig(attention_backend=backend)
        runtime.set_seed(cfg.seed)
        model = engine.build(cfg, gpt_model_fn(spec, cfg), wrap=False)[0]
        core = type(model.decoder.layers[0].self_attention.core_attention).__name__
        assert core == {"local": "DotProductAttention", "sdpa": "SDPAttention"}[backend]
        loss = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).mean()
        loss.backward()
        losses[backend] = loss.item()
        grads[backend] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    print("losses", losses, "grad max|diff|", (grads["local"] - grads["sdpa"]).abs().max().item())
    assert abs(losses["local"] - losses["sdpa"]) < TOL
    assert (grads["local"] - grads["sdpa"]).abs().max().item() < TOL


def test_the_notebooks_gpu_attention_reproduces_hf_for_every_verified_architecture(tmp_path):
    """On GPUs the notebooks load a folder with SDPA unless its sliding window needs megatron's own attention
    (notebook_model.attention_backend). Each verified architecture's tiny transformers-made model, loaded the way
    that rule says (2 gloo ranks, Megatron-FSDP, fp32), gives transformers' logits and its greedy tokens."""
    from mfsdp_kit.models import support
    from tests.dist import launch
    res, = launch.run("sequence", calls=[["scenarios_arch:arch_roundtrips", dict(
        archs=list(support.VERIFIED), tp=1, fsdp=True, workdir=str(tmp_path), attention="gpu-default", train=False)]])
    for arch, r in res.items():
        print(arch, r["attention"], r["verify"]["relative"], r["greedy"]["ok"])
        assert r["verify"]["relative"] < TOL and r["greedy"]["ok"], (arch, r)
    assert {a for a, r in res.items() if r["attention"] == "sdpa"} >= {"Qwen2ForCausalLM", "LlamaForCausalLM",
                                                                      "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}
