"""check_folder refuses, from config.json alone, every model this install would not reproduce exactly.

Configs are written by transformers' own config classes (models.archs), as a researcher's folder
would hold them; no weights are needed because the refusal comes before any weight is read."""
import pytest
import torch

from mfsdp_kit.config import ConfigError, EngineConfig
from mfsdp_kit.models import archs, hf as hf_models, support


def folder(tmp_path, arch, **overrides):
    archs.hf_config(arch, **overrides).save_pretrained(tmp_path)
    return tmp_path


def accepted(path, cfg=None):
    """Passes the config checks: the next complaint is about the (absent) weights."""
    with pytest.raises(FileNotFoundError, match="holds no weights"):
        hf_models.check_folder(path, cfg)


def test_every_listed_architecture_is_verified_or_refused():
    listed = set(hf_models.supported_architectures())
    assert listed == set(support.VERIFIED) | set(support.REFUSED)
    assert not set(support.VERIFIED) & set(support.REFUSED)


@pytest.mark.parametrize("arch", support.VERIFIED)
def test_default_tiny_configs_are_accepted(tmp_path, arch):
    accepted(folder(tmp_path, arch), EngineConfig())


@pytest.mark.parametrize("arch", ["Gemma2ForCausalLM", "GemmaForCausalLM", "Gemma3ForCausalLM", "NemotronForCausalLM",
                                  "GptOssForCausalLM", "Qwen3NextForCausalLM", "DeepseekV3ForCausalLM"])
def test_refused_architectures_name_themselves_and_the_reason(tmp_path, arch):
    with pytest.raises(ConfigError, match=rf"architectures=\['{arch}'\].*refused here: ") as e:
        hf_models.check_folder(folder(tmp_path, arch))
    assert support.REFUSED[arch] in str(e.value)


def test_gemma2_says_what_this_install_lacks(tmp_path):
    with pytest.raises(ConfigError, match="zero-centered-gamma RMSNorm.*no Transformer Engine"):
        hf_models.check_folder(folder(tmp_path, "Gemma2ForCausalLM"))


def test_llama3_rope_with_megatrons_parameters_is_accepted(tmp_path):
    accepted(folder(tmp_path, "LlamaForCausalLM", rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)))


@pytest.mark.parametrize("key,value", [("original_max_position_embeddings", 4096), ("low_freq_factor", 2.0),
                                       ("high_freq_factor", 8.0)])
def test_llama3_rope_with_other_parameters_is_refused(tmp_path, key, value):
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    scaling[key] = value
    with pytest.raises(ConfigError, match=rf"LlamaForCausalLM: rope_scaling.{key}={value!r} is not allowed; "
                                          rf"allowed: {support.LLAMA3_ROPE_DEFAULTS[key]!r}"):
        hf_models.check_folder(folder(tmp_path, "LlamaForCausalLM", rope_scaling=scaling))


@pytest.mark.parametrize("arch,scaling", [
    ("Qwen2ForCausalLM", dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
    ("LlamaForCausalLM", dict(rope_type="linear", factor=2.0)),
    ("LlamaForCausalLM", dict(rope_type="dynamic", factor=2.0)),
    ("Qwen3ForCausalLM", dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)),
])
def test_unmapped_rope_scaling_is_refused(tmp_path, arch, scaling):
    with pytest.raises(ConfigError, match=rf"{arch}: rope_scaling.rope_type='{scaling['rope_type']}' is not allowed"):
        hf_models.check_folder(folder(tmp_path, arch, rope_scaling=scaling))


def test_mistral_window_is_refused_only_with_sdpa(tmp_path):
    path = folder(tmp_path, "MistralForCausalLM", sliding_window=8)
    accepted(path, EngineConfig(attention_backend="local"))
    with pytest.raises(ConfigError, match="MistralForCausalLM: sliding_window=8 is not allowed.*no sliding-window mask"):
        hf_models.check_folder(path, EngineConfig(attention_backend="sdpa"))


def test_megatron_window_is_hfs_minus_one():
    config = dict(sliding_window=8, max_position_embeddings=256)
    assert support.megatron_window(config, [8, 0]) == (7, 0)
    assert support.megatron_window(dict(config, sliding_window=256), [256, 0]) is None
    assert support.megatron_window(config, None) is None


@pytest.mark.parametrize("arch,fields", [
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)),
    ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)),
])
def test_active_sliding_window_is_refused(tmp_path, arch, fields):
    with pytest.raises(ConfigError, match=rf"{arch}: sliding_window=8 is not allowed"):
        hf_models.check_folder(folder(tmp_path, arch, **fields))


def test_window_no_shorter_than_the_context_is_accepted(tmp_path):
    accepted(folder(tmp_path, "MistralForCausalLM", sliding_window=256))  # max_position_embeddings=256


@pytest.mark.parametrize("arch,fields,match", [
    ("Qwen3MoeForCausalLM", dict(norm_topk_prob=False), "norm_topk_prob=False"),
    ("Qwen3MoeForCausalLM", dict(mlp_only_layers=[0]), r"mlp_only_layers=\[0\]"),
    ("Qwen3MoeForCausalLM", dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
    ("OlmoeForCausalLM", dict(norm_topk_prob=True), "norm_topk_prob=True"),
    ("OlmoeForCausalLM", dict(clip_qkv=8.0), "clip_qkv=8.0"),
    ("OlmoeForCausalLM", dict(num_key_value_heads=2), "num_key_value_heads=2"),
    ("LlamaForCausalLM", dict(attention_bias=True), "attention_bias=True"),
    ("Qwen3ForCausalLM", dict(attention_bias=True), "attention_bias=True"),
    ("LlamaForCausalLM", dict(mlp_bias=True), "mlp_bias=True"),
    ("LlamaForCausalLM", dict(hidden_act="gelu_new"), "hidden_act='gelu_new'"),
])
def test_unreproduced_fields_are_refused(tmp_path, arch, fields, match):
    with pytest.raises(ConfigError, match=rf"{arch}: {match} is not allowed"):
        hf_models.check_folder(folder(tmp_path, arch, **fields))


def test_softcapping_is_refused(tmp_path):
    path = folder(tmp_path, "Qwen2ForCausalLM")
    import json
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 30.0}))
    with pytest.raises(ConfigError, match="final_logit_softcapping=30.0 is not allowed; allowed: null"):
        hf_models.check_folder(path)


@pytest.mark.parametrize("arch, ep, match", [
    ("Qwen2ForCausalLM", 2, "expert_model_parallel_size=2 is not allowed; allowed: 1 for Qwen2ForCausalLM: it has no MoE"),
    ("Qwen3MoeForCausalLM", 3, "expert_model_parallel_size=3 is not allowed; allowed: a divisor of the model's "
                               "num_experts=4"),
])
def test_expert_parallel_needs_experts_it_divides(tmp_path, arch, ep, match):
    with pytest.raises(ConfigError, match=match):
        hf_models.check_folder(folder(tmp_path, arch), EngineConfig(expert_model_parallel_size=ep))


def test_expert_parallel_two_is_accepted(tmp_path):
    accepted(folder(tmp_path, "OlmoeForCausalLM"), EngineConfig(expert_model_parallel_size=2))


def test_olmoe_refuses_tensor_parallel(tmp_path):
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=2 is not allowed; allowed: 1 for OlmoeForCausalLM"):
        hf_models.check_folder(folder(tmp_path, "OlmoeForCausalLM"), EngineConfig(tensor_model_parallel_size=2))


def test_moe_refuses_tensor_parallel_without_sequence_parallel(tmp_path):
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=2 is not allowed; allowed: 1 for "
                                          "Qwen3MoeForCausalLM.*sequence parallelism"):
        hf_models.check_folder(folder(tmp_path, "Qwen3MoeForCausalLM"), EngineConfig(tensor_model_parallel_size=2))


def test_auto_attention_is_local_on_cpu_and_keeps_a_sliding_window_local(monkeypatch):
    """"auto": megatron's local attention on CPU; on a GPU torch's SDPA (packed rows), unless the model's config has
    an active sliding window, which only "local" reproduces."""
    import torch
    cfg = EngineConfig()
    assert cfg.kernels.attention_backend == "auto" and support.attention_backend(cfg) == "local"
    assert support.attention_backend(EngineConfig(attention_backend="sdpa")) == "sdpa"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # runtime not started: the host's GPUs decide
    assert support.attention_backend(cfg) == "sdpa"
    windowed = {"sliding_window": 64, "max_position_embeddings": 4096}
    assert support.attention_backend(cfg, windowed) == "local"


def _raw_folder(tmp_path, **overrides):
    """config.json written as JSON (transformers' config classes refuse some absurd values themselves)."""
    import json
    config = archs.hf_config("Qwen2ForCausalLM").to_dict()
    config.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("fields, match", [
    (dict(vocab_size=-5), r"vocab_size=-5 is not allowed; allowed: an int >= 1"),
    (dict(hidden_size=0), r"hidden_size=0 is not allowed"),
    (dict(num_attention_heads=2.5), r"num_attention_heads=2.5 is not allowed"),
    (dict(intermediate_size="128"), r"intermediate_size='128' is not allowed"),
    (dict(num_hidden_layers=True), r"num_hidden_layers=True is not allowed"),
    (dict(hidden_size=2 ** 31), r"hidden_size=2147483648 makes a model of about .* GiB in bf16\), more than 2 x "
                                r"this host's memory .*the largest published hidden_size is 16384"),
    (dict(num_hidden_layers=10 ** 6, hidden_size=1024, intermediate_size=4096),
     r"num_hidden_layers=1000000 makes a model of about"),
    (dict(vocab_size=2 ** 40), r"vocab_size=1099511627776 makes a model"),
], ids=["vocab_neg", "hidden0", "heads_float", "ffn_str", "layers_bool", "hidden_2_31", "layers_1e6", "vocab_2_40"])
def test_absurd_sizes_are_named_before_anything_is_built(tmp_path, fields, match):
    with pytest.raises(ConfigError, match=match):
        hf_models.check_folder(_raw_folder(tmp_path, **fields))


def test_parameter_count_is_the_models():
    """The estimate against transformers' own count, on the meta device (no memory)."""
    import torch
    import transformers
    for arch in ("Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM"):
        config = archs.hf_config(arch, hidden_size=256, intermediate_size=512)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        real = sum(p.numel() for p in model.parameters())
        assert abs(support.parameter_count(config.to_dict()) - real) / real < 0.05, arch


@pytest.mark.parametrize("capability,hip,installed,runs", [
    ((9, 0), False, True, True), ((8, 0), False, True, True), ((8, 9), False, True, True),
    ((7, 5), False, True, False), ((7, 0), False, True, False),   # Turing, Volta: no bf16 dots
    ((9, 0), True, True, False),                                  # a ROCm build: not what the kernels were run on
    ((9, 0), False, False, False)])                               # no Triton
def test_triton_needs_triton_an_nvidia_gpu_and_sm80(capability, hip, installed, runs):
    assert support.triton_supports(capability=capability, hip=hip, triton_installed=installed) is runs


def test_triton_is_available_on_a_visible_cuda_device_only():
    assert not support.triton_available("cpu") and not support.triton_available(torch.device("meta"))
    if not torch.cuda.is_available():
        assert not support.triton_available() and not support.triton_available("cuda")
