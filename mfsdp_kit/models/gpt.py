"""A Megatron-Core GPT built from sizes (local layer spec): the model of the parity tests and
benchmarks, no Hugging Face folder needed. HF models go through `models.hf` instead."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import EngineConfig
from . import transformer_settings
from .support import attention_backend


@dataclass(kw_only=True)
class GPTSpec:
    """Shape of a Llama-style GPT (RMSNorm, SwiGLU, RoPE, untied embeddings)."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    """KV heads (GQA); None = one per attention head."""
    ffn_hidden_size: int | None = None
    """MLP width; None = 4 * hidden_size (SwiGLU halves the effective width per matrix)."""
    vocab_size: int = 128
    seq_len_tokens: int = 32
    """Longest sequence the position embedding covers."""
    num_experts: int | None = None
    """MoE: routed experts per layer (every layer's MLP becomes a megatron MoE layer, experts split
    over `EngineConfig.parallelism.expert_model_parallel_size` ranks); None = a dense MLP."""
    moe_ffn_hidden_size: int | None = None
    """Width of one expert's SwiGLU MLP; None = ffn_hidden_size."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""

    def param_count(self) -> int:
        """Parameters of the model (embeddings and output layer included; MoE: every expert and the router)."""
        h = self.hidden_size
        kv = (self.num_query_groups or self.num_attention_heads) * (h // self.num_attention_heads)
        per_layer = h * (h + 2 * kv) + h * h + self._mlp_params(active=False) + 2 * h
        return self.num_layers * per_layer + 2 * self.vocab_size * h + h

    def active_param_count(self) -> int:
        """Parameters one token passes through: MoE counts topk experts (what 6 * N FLOPs/token uses)."""
        return self.param_count() - self.num_layers * (self._mlp_params(active=False) - self._mlp_params(active=True))

    def _mlp_params(self, *, active: bool) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size or 4 * self.hidden_size
        if not self.num_experts:
            return 3 * h * f   # SwiGLU: gate, up (h -> f) and down (f -> h)
        experts = self.moe_router_topk if active else self.num_experts
        return experts * 3 * h * (self.moe_ffn_hidden_size or f) + h * self.num_experts   # + the router


SPECS = {
    # the CPU smoke size of the benchmarks (2 gloo ranks, seconds per step)
    "tiny": GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                    vocab_size=128, seq_len_tokens=32),
    # 24 * (4 * 2048^2 + 3 * 2048 * 5632) = 1.23 B in layers + 2 * 32768 * 2048 = 0.13 B embeddings
    "1.7b": GPTSpec(num_layers=24, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=5632,
                    vocab_size=32768, seq_len_tokens=2048),
    # 26 * (4 * 3072^2 + 3 * 3072 * 8192) = 2.94 B + 0.20 B embeddings
    "3b": GPTSpec(num_layers=26, hidden_size=3072, num_attention_heads=24, ffn_hidden_size=8192,
                  vocab_size=32768, seq_len_tokens=2048),
    # Llama-2-7B shape: 32 * (4 * 4096^2 + 3 * 4096 * 11008) = 6.48 B + 0.27 B embeddings
    "7b": GPTSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                  vocab_size=32768, seq_len_tokens=2048),
}
"""Named model sizes of the benchmarks (bench/throughput.py --spec, bench/max_model.py --spec)."""

MOE_SPECS = {
    # MoE smoke size: 4 experts of width 32, top-2 (2 gloo ranks split them at EP 2)
    "moe-tiny": GPTSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                        vocab_size=128, seq_len_tokens=32, num_experts=4, moe_ffn_hidden_size=32),
    # Qwen3-MoE-shaped: 16 * (1024 * (1024 + 2 * 256) + 1024^2 + 32 * 3 * 1024 * 768 + 32 * 1024) = 1.25 B
    # in layers + 2 * 32768 * 1024 = 0.07 B embeddings = 1.32 B; top-4 of 32 experts: 0.26 B active per token
    "moe-1.3b": GPTSpec(num_layers=16, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                        ffn_hidden_size=3072, vocab_size=32768, seq_len_tokens=2048, num_experts=32,
                        moe_ffn_hidden_size=768, moe_router_topk=4),
}
"""Named MoE sizes (bench/moe_throughput.py --spec). Apart from SPECS: the dense benchmarks' FLOPs
(perf.flops) count every parameter, an MoE token passes through topk experts only."""


def transformer_config(spec: GPTSpec, cfg: EngineConfig):
    """megatron TransformerConfig for `spec` under `cfg` (`transformer_settings`: parallel sizes, dtype, overrides)."""
    from megatron.core.transformer import TransformerConfig
    kwargs = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups, ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, **_moe_settings(spec),
    )
    # the local layer spec always (te_spec=False); CPU init: every layout starts from the same weights
    kwargs.update(transformer_settings.engine_settings(cfg, te_spec=False, moe=bool(spec.num_experts),
                                                       cpu_initialization=True))
    kwargs.update(transformer_settings.fused_kernel_settings(cfg, kwargs, te_spec=False))
    return TransformerConfig(**kwargs)


def _moe_settings(spec: GPTSpec) -> dict:
    """TransformerConfig fields of an MoE spec: megatron's SequentialMLP experts (no TE grouped GEMM),
    all-to-all token dispatch (what expert parallelism needs), no auxiliary loss (the loss stays the
    language-model loss, comparable across layouts)."""
    if not spec.num_experts:
        return {}
    return dict(num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size or spec.ffn_hidden_size,
                moe_router_topk=spec.moe_router_topk, moe_token_dispatcher_type="alltoall",
                moe_router_load_balancing_type="none")   # the TE-only fusions: transformer_settings.MOE_TE_ONLY


def layer_spec(cfg: EngineConfig, num_experts: int | None = None):
    """Local (no Transformer Engine) layer spec; core attention per `cfg.kernels.attention_backend`; a MoE MLP
    of megatron's SequentialMLP experts when `num_experts`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", num_experts=num_experts, moe_grouped_gemm=False)
    backend = attention_backend(cfg)
    if backend != "local":
        from .flex import core_attention
        spec.submodules.self_attention.submodules.core_attention = core_attention(backend)
    return spec


def gpt_model_fn(spec: GPTSpec, cfg: EngineConfig):
    """A `model_fn(pre_process=, post_process=, vp_stage=)` for `engine.build`."""
    from megatron.core.models.gpt import GPTModel
    config = transformer_config(spec, cfg)
    if spec.num_experts:
        from .. import compat
        compat.apply("moe_without_te")   # megatron-core only; the bridge is not imported

    def model_fn(*, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None):
        return GPTModel(config=config, transformer_layer_spec=layer_spec(cfg, spec.num_experts),
                        vocab_size=spec.vocab_size,
                        max_sequence_length=spec.seq_len_tokens, pre_process=pre_process,
                        post_process=post_process, position_embedding_type="rope",
                        share_embeddings_and_output_weights=False, vp_stage=vp_stage)
    return model_fn
