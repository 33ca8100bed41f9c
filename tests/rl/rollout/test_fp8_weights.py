"""FP8 rollout weights (`DecodeConfig.weights="fp8"`, rl.rollout.fp8_weights): refused by name where they cannot run
(no CUDA device, an unknown value, reduce-overhead graphs), the default path untouched (no copies, the same tokens
as HF), the copies re-quantized in place exactly when a weight changes, and the bytes a step reads about halved. On
a GPU of sm89+: FP8 decode against bf16 decode on a tiny bf16 model (log-probs close, greedy tokens mostly the same),
and a change of the weights picked up by the next call without re-capturing its graphs. On CPU the same wiring
with the GEMM's fp32 reference in place of `torch._scaled_mm`."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mfsdp_kit.config import ConfigError
from mfsdp_kit.models.archs import write_tiny
from mfsdp_kit.rl.rollout import ContinuousRollout, DecodeConfig, decoder, fp8_weights

FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
ROWS = [[5, 17, 42, 9, 77, 3, 120], [8, 8, 200], [31, 64, 11, 150, 151], [7], [90, 91, 92, 93, 94, 95, 96], [12, 13]]


def shared_prefix_gaps(tokens, logprobs, ref_tokens, ref_logprobs) -> list[float]:
    """|log-prob difference| of each token up to the first where two greedy decodes of a row part (same context)."""
    gaps = []
    for a, la, b, lb in zip(tokens, logprobs, ref_tokens, ref_logprobs):
        for s, x, t, y in zip(a, la, b, lb):
            if s != t:
                break
            gaps.append(abs(x - y))
    return gaps


def tiny(tmp_path, dtype=torch.float32, device="cpu"):
    folder = write_tiny("Qwen2ForCausalLM", tmp_path / "qwen2")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal off a CUDA device")
def test_fp8_is_refused_by_name_without_cuda():
    with pytest.raises(ConfigError, match=r"weights='fp8' is not allowed; allowed: .*no CUDA device"):
        DecodeConfig(weights="fp8")


@pytest.mark.parametrize("fields,match", [(dict(weights="int8"), r"weights='int8' is not allowed; allowed: 'model' \| 'fp8'"),
                                          (dict(weights="fp8", graph_mode="reduce-overhead"),
                                           r"weights='fp8' is not allowed; allowed: \"model\" with graph_mode")])
def test_values_it_cannot_serve_are_refused_by_name(fields, match):
    with pytest.raises(ConfigError, match=match):
        DecodeConfig(**fields)


def test_the_default_path_keeps_no_copies(tmp_path):
    model, tok = tiny(tmp_path)
    rollout = ContinuousRollout(model, tok, config=DecodeConfig(max_batch_size=4, check_every=3, slot_bucket=8))
    assert DecodeConfig().weights == "model" and rollout.runner.fp8 is None
    out, _ = rollout.generate(ROWS, max_new_tokens=8, temperature=0, top_p=1.0, seed=0)
    assert all(len(r) == 8 for r in out)
    assert not [n for m in model.modules() for n in vars(m) if n.endswith("_fp8")]


def test_copies_are_requantized_in_place_when_a_weight_changes(tmp_path):
    """`Fp8Weights.update` (CPU: the quantization only, no FP8 GEMM): made once, kept while nothing changed, made
    again into the same tensors after an in-place write (what the weight sync does) and after `load_state_dict`."""
    model, _ = tiny(tmp_path, dtype=torch.bfloat16)
    decoder.fuse_projections(model)
    copies = fp8_weights.Fp8Weights(model, kernel=False)
    assert copies.update() and not copies.update() and copies.quantized == 1
    attn = model.model.layers[1].self_attn
    first, ptr = attn.kit_qkv_fp8.q.float().clone(), attn.kit_qkv_fp8.q.data_ptr()
    with torch.no_grad():
        attn.k_proj.weight.mul_(3)   # a view of the fused q/k/v tensor
    assert copies.update() and attn.kit_qkv_fp8.q.data_ptr() == ptr and not torch.equal(attn.kit_qkv_fp8.q.float(), first)
    q, scale = attn.kit_qkv_fp8.q, attn.kit_qkv_fp8.scale
    torch.testing.assert_close((q.float() * scale.reshape(-1, 1)).to(torch.bfloat16), attn.kit_qkv_weight,
                               rtol=2 ** -4, atol=1e-3)
    state = {k: v.clone() * 0.5 for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    assert copies.update() and copies.quantized == 3 and not copies.update()
    mlp = model.model.layers[0].mlp
    assert {n for n in vars(mlp) if n.endswith("_fp8")} == {"kit_gate_up_fp8", "kit_down_fp8"}


def test_a_step_reads_about_half_the_weight_bytes(tmp_path):
    model, _ = tiny(tmp_path, dtype=torch.bfloat16)
    bf16, fp8 = (fp8_weights.step_weight_bytes(model, fp8=f) for f in (False, True))
    linear = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    scales = sum(p.shape[0] for n, p in model.named_parameters() if n.endswith("proj.weight"))
    assert bf16 - fp8 == linear - 4 * scales
    assert bf16 == sum(2 * p.numel() for n, p in model.named_parameters() if "embed" not in n)


gpu = pytest.mark.skipif(not FP8_GPU, reason="FP8 GEMMs: a CUDA GPU of compute capability 8.9+")


@gpu
def test_fp8_decode_is_close_to_bf16_decode(tmp_path):
    """The same rows decoded greedily by a bf16 engine and an FP8 one (separate models of the same weights): the FP8
    engine's log-probs of its own tokens within 0.1 nats of the bf16 model's where the tokens agree (two e4m3
    roundings per GEMM), and at least half the rows' first 4 tokens the same (a random tiny model's logits are
    nearly flat: on CPU with the reference GEMM, 2 rows of 6 kept all 12 greedy tokens, at 0.016 nats)."""
    rows = [[(7 * i + j) % 250 + 3 for j in range(5 + i % 7)] for i in range(32)]
    outs = {}
    for weights in ("model", "fp8"):
        model, tok = tiny(tmp_path / weights, dtype=torch.bfloat16, device="cuda")
        rollout = ContinuousRollout(model, tok, config=DecodeConfig(weights=weights))
        outs[weights] = rollout.generate(rows, max_new_tokens=16, temperature=0, top_p=1.0, seed=0)
    (ref, ref_lp), (ours, lp) = outs["model"], outs["fp8"]
    assert sum(a[:4] == b[:4] for a, b in zip(ours, ref)) >= len(rows) // 2
    diffs = shared_prefix_gaps(ours, lp, ref, ref_lp)
    assert diffs and max(diffs) < 0.1, max(diffs)


@gpu
def test_a_weight_change_is_picked_up_without_recapturing(tmp_path):
    model, tok = tiny(tmp_path, dtype=torch.bfloat16, device="cuda")
    rollout = ContinuousRollout(model, tok, config=DecodeConfig(weights="fp8"))
    kw = dict(max_new_tokens=12, temperature=0, top_p=1.0, seed=0)
    before, _ = rollout.generate(ROWS, **kw)
    made, copies = rollout.runner.made, rollout.runner.fp8
    assert copies.quantized == 1 and rollout.generate(ROWS, **kw)[0] == before and copies.quantized == 1
    with torch.no_grad():   # as the sync writes: in place, by name
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(-1)
            layer.self_attn.o_proj.weight.mul_(0.5)
    after, _ = rollout.generate(ROWS, **kw)
    assert copies.quantized == 2 and rollout.runner.made == made and after != before
    fresh = ContinuousRollout(model, tok, config=DecodeConfig(weights="fp8"))
    assert fresh.generate(ROWS, **kw)[0] == after   # the same tokens as copies made from the new weights


def test_the_fp8_path_is_wired_end_to_end_with_the_reference_gemm_on_cpu(tmp_path, monkeypatch):
    """The engine's FP8 path on CPU with the GPU-only GEMM replaced by its fp32 reference (`dequantized_linear`, the
    numbers `torch._scaled_mm` is checked against on a GPU) and the device refusal lifted: what the test checks is
    the wiring -- every projection routed through its copy, greedy tokens close to the bf16 engine's, and a weight
    written in place (as the sync writes) re-quantized and used by the next call."""
    from mfsdp_kit.rl.rollout.kernels import fp8 as fp8_kernels
    calls = []

    def reference(x, q, scale, bias=None, *, kernel):
        calls.append(q.shape)
        return fp8_kernels.dequantized_linear(x, q, scale, bias)
    monkeypatch.setattr(fp8_weights, "refuse_device", lambda device=None: None)
    monkeypatch.setattr(fp8_weights, "scaled_linear", reference)
    kw = dict(max_new_tokens=12, temperature=0, top_p=1.0, seed=0)
    outs = {}
    for weights in ("model", "fp8"):
        model, tok = tiny(tmp_path / weights, dtype=torch.bfloat16)
        rollout = ContinuousRollout(model, tok, config=DecodeConfig(weights=weights, max_batch_size=8))
        outs[weights] = rollout.generate(ROWS, **kw)
    layers = len(model.model.layers)
    assert calls and len({tuple(s) for s in calls}) == 4 and len(calls) % (4 * layers) == 0   # qkv, o, gate_up, down
    (ref, ref_lp), (ours, lp) = outs["model"], outs["fp8"]
    assert sum(a[:4] == b[:4] for a, b in zip(ours, ref)) >= len(ROWS) // 2, (ours, ref)
    diffs = shared_prefix_gaps(ours, lp, ref, ref_lp)
    assert diffs and max(diffs) < 0.1, max(diffs)
    copies, before = rollout.runner.fp8, ours
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(-1)
    after, _ = rollout.generate(ROWS, **kw)
    assert copies.quantized == 2 and after != before
