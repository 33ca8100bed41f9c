"""Which HF architectures and config fields this install reproduces exactly - decided from config.json alone.

Megatron-Bridge 0.3.1 lists 24 architectures, and for each it maps a subset of config.json onto
megatron's TransformerConfig. A field it does not map is dropped without a word: a Llama 3 folder
whose `rope_scaling.original_max_position_embeddings` is not 8192 loads, trains, and computes
logits 0.27 away from HF's (scale 2.3). The naive check (is the architecture listed?) accepts that
model, and also Gemma2 and the MoE families, which then fail deep inside megatron after the user
waited for the load. `check_config` answers first, from config.json only, with a `ConfigError`
naming the architecture or field, its value, and why:

- REFUSED: architectures that cannot run in this install (no Transformer Engine, CPU/GPU torch only)
  or that the kit has not verified to convert exactly; the reason says what is missing (`models.archs.refused`).
- per-field rules for the architectures that work (VERIFIED): every field that changes the model
  and that the bridge does not map exactly (rope scaling variants and their parameters, sliding
  windows, soft-capping, MoE routing variants, biases the bridge has no mapping for). The rules every family
  shares are here; what one family's bridge maps besides (a rope scaling type, a sliding window, q/k/v biases)
  and its own rules (MoE routing, tensor parallelism) are fields of its spec (`models.archs.spec.ArchSpec`).
"""
from __future__ import annotations

import importlib.util
import os

import torch

from ..config import ConfigError, EngineConfig, bad_value
from . import archs
from .archs.llama import LLAMA3_ROPE_DEFAULTS  # noqa: F401 (importable here as before)
from .archs.spec import ArchSpec, refuse

VERIFIED, REFUSED = archs.VERIFIED, archs.REFUSED
"""`models.archs`' views, importable here as before: the architectures that work, and those refused with the reason."""

ACTIVATIONS = ("silu", "gelu", "relu", "relu2", "tanh", "gelu_pytorch_tanh")
"""hidden_act values the bridge maps (model_bridge.py ACTIVATION_MAPPING); others raise inside the bridge."""


def check_config(config: dict, cfg: EngineConfig | None = None) -> str:
    """Raise ConfigError unless this install reproduces the config.json `config` exactly; return
    the architecture the bridge will use. The rules every family shares are here; what one family's bridge maps
    besides, or refuses besides, is its spec's (`models.archs`)."""
    arch = next((a for a in config.get("architectures") or [] if a in archs.ARCHS or a in archs.REFUSED), None)
    if arch is None:
        raise bad_value("architectures", config.get("architectures"), ", ".join(archs.VERIFIED))
    if arch in archs.REFUSED:
        raise ConfigError(f"architectures=[{arch!r}] is listed by Megatron-Bridge 0.3.1 but refused here: "
                          f"{archs.REFUSED[arch]}. Working architectures: {', '.join(archs.VERIFIED)}")
    spec = archs.ARCHS[arch]
    check_sizes(config)
    for check in (_rope, _sliding_window, _softcapping, _activation, _biases):
        check(spec, config, cfg)
    if spec.check is not None:
        spec.check(config)
    if cfg is not None:
        _parallel(spec, config, cfg)
    return arch


SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "vocab_size", "max_position_embeddings", "head_dim", "moe_intermediate_size", "num_experts",
               "num_local_experts", "num_experts_per_tok", "shared_expert_intermediate_size")
"""config.json sizes that must be ints >= 1 where present (null: the field is unused)."""
LARGEST_PUBLISHED = dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, vocab_size=262144,
                         moe_intermediate_size=18432, num_experts=384, num_local_experts=384)
"""Each size's largest value in published models (Llama 3.1 405B: 16384 / 53248 / 126; Gemma 3: vocab 262144;
Kimi K2: 384 experts), to name the field that makes an absurd model absurd."""
HOST_MEMORY_FACTOR = 2
"""A model is refused when its bf16 weights (2 bytes a parameter) exceed 2 x this host's memory: the load holds
each rank's TP x PP slice unsharded in host memory (models.hf), so beyond a pipeline split over two such hosts the
load cannot fit; the naive load found out by failing inside torch ("Storage size calculation overflowed")."""


def parameter_count(config: dict) -> int:
    """About how many parameters config.json describes: embeddings (and an untied output layer), per layer the
    attention projections and the gated MLP (per expert, with MoE). Python ints: no overflow at any size."""
    hidden, layers, vocab = (int(config.get(k) or 1) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
    heads = int(config.get("num_attention_heads") or 1)
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or max(1, hidden // heads))
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    ffn = int((config.get("moe_intermediate_size") if experts else None) or config.get("intermediate_size") or 1)
    mlp = 3 * hidden * ffn * max(1, experts)
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return embeddings + layers * (attention + mlp)


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_sizes(config: dict) -> None:
    """Every size an int >= 1, and the model no larger than HOST_MEMORY_FACTOR x host memory in bf16: a
    ConfigError naming the field, before anything is built (the naive build allocated first: "negative
    dimension -5", "Storage size calculation overflowed", transformers' own errors)."""
    for name in SIZE_FIELDS:
        value = config.get(name)
        if value is None and name not in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad_value(name, value, "an int >= 1 (a size)")
    count, memory = parameter_count(config), host_memory_bytes()
    if 2 * count > HOST_MEMORY_FACTOR * memory:
        field = max(LARGEST_PUBLISHED, key=lambda k: (config.get(k) or 0) / LARGEST_PUBLISHED[k])
        raise ConfigError(f"{field}={config[field]} makes a model of about {count:.3g} parameters ({2 * count / 2**30:.3g} "
                          f"GiB in bf16), more than {HOST_MEMORY_FACTOR} x this host's memory ({memory / 2**30:.3g} GiB); "
                          f"allowed: sizes whose model fits (the largest published {field} is "
                          f"{LARGEST_PUBLISHED[field]}). Check config.json's {field}")


def _rope(spec: ArchSpec, config: dict, cfg) -> None:
    scaling = config.get("rope_scaling")
    if not scaling:
        return
    kind, arch = scaling.get("rope_type") or scaling.get("type"), spec.architecture
    if kind in (None, "default"):
        return
    if kind in spec.rope_scaling:
        for key, megatron_value in spec.rope_scaling[kind].items():
            if key in scaling and float(scaling[key]) != float(megatron_value):
                raise refuse(arch, f"rope_scaling.{key}", scaling[key], repr(megatron_value),
                             f"megatron's {kind} RoPE scaling fixes it (rotary_pos_embedding.py:92-98) and the bridge "
                             "maps only rope_scaling.factor: the frequencies, and so every logit, would differ "
                             "from HF's")
        return
    allowed = "null or 'default'" + "".join(f", or {k!r} with megatron's fixed parameters" for k in spec.rope_scaling)
    raise refuse(arch, "rope_scaling.rope_type", kind, allowed,
                 f"the {arch} bridge does not map {kind!r} RoPE scaling onto megatron (it is dropped or only "
                 "partly mapped): the model would use different position frequencies than HF")


def active_window(config: dict) -> int | None:
    """The sliding window HF applies to some layer, or None when attention is full everywhere."""
    window = config.get("sliding_window")
    if window is None:
        return None
    if "use_sliding_window" in config and not config["use_sliding_window"]:
        return None
    layer_types = config.get("layer_types")
    if layer_types and "sliding_attention" not in layer_types:
        return None
    if window >= config.get("max_position_embeddings", float("inf")):
        return None  # no sequence the model accepts is longer than the window
    return window


def attention_backend(cfg: EngineConfig, config: dict | None = None) -> str:
    """The core attention `cfg.kernels.attention_backend` names, "auto" resolved: "sdpa" on a GPU (the model then
    takes packed rows: `packing`), unless the HF `config` has an active sliding window, which only megatron's
    "local" attention reproduces; "local" on CPU, where the kit's checks compare megatron's own kernels at fp32."""
    chosen = cfg.kernels.attention_backend
    if chosen != "auto":
        return chosen
    return "sdpa" if on_gpu() and active_window(config or {}) is None else "local"


def on_gpu() -> bool:
    """Does this process's model live on a GPU (the runtime's device; before `runtime.init`, whether one exists)?
    What the "auto" kernel choices resolve against."""
    from ..distributed import runtime
    return runtime.current().device.type == "cuda" if runtime.is_initialized() else torch.cuda.is_available()


TRITON_MIN_CAPABILITY = (8, 0)
"""The oldest NVIDIA GPU the kit's Triton kernels are for (`models.triton_fusions`, `rl.rollout.kernels.attention` /
`elementwise`, which the "auto" kernel choices take on such a GPU): bf16 loads, stores and dots need sm80
(Ampere); they were measured on sm90 (docs/benchmarks.md, "The Triton kernels by default"). Older GPUs, and ROCm
builds, keep the torch path."""


def triton_supports(*, capability: tuple[int, int], hip: bool, triton_installed: bool) -> bool:
    """Whether a GPU of compute `capability` ((major, minor)) runs the kernels: Triton installed, NVIDIA (not a ROCm
    build of torch: `hip`), capability >= TRITON_MIN_CAPABILITY."""
    return triton_installed and not hip and tuple(capability) >= TRITON_MIN_CAPABILITY


def triton_available(device: torch.device | str | None = None) -> bool:
    """`triton_supports` for `device` (a CUDA device; None: the current one); False for any other device type, or
    where no GPU is visible. Triton is not imported here: only the engines that use the kernels load it."""
    if device is not None and torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    return triton_supports(capability=torch.cuda.get_device_capability(device), hip=torch.version.hip is not None,
                           triton_installed=importlib.util.find_spec("triton") is not None)


def _sliding_window(spec: ArchSpec, config: dict, cfg) -> None:
    window, arch = active_window(config), spec.architecture
    if window is None:
        return
    if not spec.sliding_window:
        raise refuse(arch, "sliding_window", window, "null (or >= max_position_embeddings, or use_sliding_window="
                     "false): if your sequences never exceed the window, set sliding_window to null in config.json",
                     f"the {arch} bridge does not map sliding windows: megatron would attend over the full "
                     "sequence where HF attends over the last sliding_window tokens")
    if cfg is not None and attention_backend(cfg, config) != "local":
        raise refuse(arch, "sliding_window", window, f"null with kernels.attention_backend="
                     f"{cfg.kernels.attention_backend!r} (the window works with attention_backend='local' or 'auto')",
                     "the kit's SDPA attention has no sliding-window mask")


def megatron_window(config: dict, bridge_window):
    """The megatron `window_size` that reproduces HF's sliding window exactly (None: full attention).

    HF lets query q see keys q - sliding_window < k <= q (masking_utils.sliding_window_overlay):
    sliding_window keys. megatron's window (w, 0) lets it see q - w <= k <= q
    (transformer/utils.py:38-45 get_sliding_window_causal_mask): w + 1 keys. The Mistral bridge maps
    window_size = (sliding_window, 0) (mistral_bridge.py:54-56), one key too many (logits were 0.16
    of the logit scale off at sliding_window=8 over 16 tokens); (sliding_window - 1, 0) is exact.
    A window no shorter than the context is full attention: None (SDPA has no window mask)."""
    if bridge_window is None:
        return None
    window = active_window(config)
    if window is None:
        return None
    return (window - 1, 0)


def _softcapping(spec: ArchSpec, config: dict, cfg) -> None:
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(field) is not None:
            raise refuse(spec.architecture, field, config[field], "null",
                         f"the {spec.architecture} bridge and megatron's GPT layers have no logit soft-capping")


def _activation(spec: ArchSpec, config: dict, cfg) -> None:
    act = config.get("hidden_act") or config.get("hidden_activation") or "silu"
    if act not in ACTIVATIONS:
        raise refuse(spec.architecture, "hidden_act", act, " | ".join(ACTIVATIONS),
                     "the bridge maps only these activations")


def _biases(spec: ArchSpec, config: dict, cfg) -> None:
    arch = spec.architecture
    if config.get("mlp_bias"):
        raise refuse(arch, "mlp_bias", True, "false", "the bridge maps mlp_bias onto megatron's add_bias_linear, "
                     "which also adds attention-output biases HF does not have: not an exact conversion")
    if config.get("attention_bias") and not spec.attention_bias:
        raise refuse(arch, "attention_bias", True, "false",
                     f"{arch} with attention_bias also has an o_proj bias, which the bridge does not map "
                     "(it maps only the q/k/v biases)")


def _parallel(spec: ArchSpec, config: dict, cfg: EngineConfig) -> None:
    par, arch = cfg.parallelism, spec.architecture
    ep, tp = par.expert_model_parallel_size, par.tensor_model_parallel_size
    experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts")
    if ep != 1 and not experts:
        raise bad_value("parallelism.expert_model_parallel_size", ep, f"1 for {arch}: it has no MoE layers whose "
                        "experts expert parallelism could split")
    if ep != 1 and experts % ep:
        raise bad_value("parallelism.expert_model_parallel_size", ep, f"a divisor of the model's num_experts={experts} "
                        "(each expert-parallel rank holds num_experts / expert_model_parallel_size experts)")
    if spec.no_tensor_parallel is not None and tp != 1:
        raise bad_value("parallelism.tensor_model_parallel_size", tp, f"1 for {arch}: {spec.no_tensor_parallel}")
    if experts and tp != 1:
        raise bad_value("parallelism.tensor_model_parallel_size", tp,
                        f"1 for {arch} (MoE): megatron-core 0.16.1 requires sequence parallelism with MoE and "
                        "TP > 1 (transformer_config.py:__post_init__), which the kit's model path does not enable: "
                        "it splits every forward's sequence over the TP ranks (tensor_parallel/mappings.py:70 needs "
                        "a length divisible by TP), which greedy decoding (one token longer per step) and the data "
                        "path do not guarantee. Use expert_model_parallel_size to split the experts instead")
