"""Megatron's TransformerConfig settings from an `EngineConfig`, once, for both model paths: `models.gpt` (a GPT
from sizes, megatron's local layer spec) and `models.hf` (a Megatron-Bridge provider, Transformer Engine's spec
where TE is installed).

What both get: the parallel sizes, sequence_parallel=False, the dtype, dropout 0, the recompute mapping, then the
user's `override_transformer_config`, then the compiled kernels of `kernels.fused_kernels` (`models.fusions`).
Where they differ, the difference is an argument, said at the call:
- `te_spec`: under Transformer Engine's layer spec TE's own fused kernels run, so neither the TE-only fusions are
  switched off (FUSIONS_OFF, NATIVE_CE_FUSION_OFF, MOE_TE_ONLY) nor the kit's compiled ones switched on. The GPT
  path always builds the local spec; the HF path builds TE's where TE is installed.
- `cpu_initialization`: the GPT path initialises its weights on CPU everywhere (megatron then initialises the
  full matrix and splits it, so TP 1 and TP 2 start from the same weights: the parity tests compare them); the HF
  path overwrites its init with the folder's weights, so it initialises on the GPU when there is one.
"""
from __future__ import annotations

from typing import Any

from ..config import EngineConfig
from ..distributed.introspect import torch_dtype
from . import fusions, support

FUSIONS_OFF = dict(gradient_accumulation_fusion=False, persist_layer_norm=False, bias_activation_fusion=False,
                   masked_softmax_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False)
"""Fused kernels that need Transformer Engine or Apex; off on the local spec."""

NATIVE_CE_FUSION_OFF = dict(cross_entropy_loss_fusion=False)
"""The bridge's providers switch on megatron's "native" fused cross-entropy, which without TE is torch.compile of
four functions (fusions/fused_cross_entropy.py). Measured: no faster at vocabulary 32768 and more peak memory
(docs/benchmarks.md, "levers, second set"), and its compile costs each process seconds at its first step (CPU,
warm compile cache; docs/benchmarks.md, notebooks, "Then per process"), i.e. in every notebook. Off, megatron's
unfused vocab-parallel cross entropy computes the same fp32 loss, as megatron-core's own default;
`override_transformer_config={"cross_entropy_loss_fusion": True}` turns it back on."""

MOE_TE_ONLY = dict(moe_permute_fusion=False, moe_grouped_gemm=False, moe_router_fusion=False)
"""MoE fusions the Qwen3-MoE and OLMoE bridges switch on that exist only with Transformer Engine:
`moe_permute_fusion` imports TE's fused_permute (megatron-core 0.16.1 transformer_config.py:1834,
an ImportError without TE), `moe_grouped_gemm` builds TEGroupedMLP. Off, the experts run as
megatron's SequentialMLP (one local matmul per expert) with unfused permutation: the same math."""

RECOMPUTE = {"none": {}, "selective": dict(recompute_granularity="selective"),
             "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)}
"""`EngineConfig.recompute` -> TransformerConfig fields ("full": every layer, one at a time)."""


def engine_settings(cfg: EngineConfig, *, te_spec: bool, moe: bool, cpu_initialization: bool) -> dict[str, Any]:
    """TransformerConfig fields for `cfg`, `override_transformer_config` applied last (it wins). `moe`: the model
    has routed experts (their TE-only fusions go off too)."""
    dtype, par = torch_dtype(cfg.dtype), cfg.parallelism
    settings = dict(
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
        context_parallel_size=par.context_parallel_size, expert_model_parallel_size=par.expert_model_parallel_size,
        sequence_parallel=False,
        bf16=cfg.dtype == "bf16", fp16=cfg.dtype == "fp16", params_dtype=dtype, pipeline_dtype=dtype,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=cpu_initialization,
        **RECOMPUTE[cfg.recompute],
    )
    if moe:   # megatron's RouterReplay on every router: idle (its own top-k) until `router_replay` sets routes
        settings.update(moe_enable_routing_replay=True)
    if not te_spec:
        settings.update(FUSIONS_OFF, **NATIVE_CE_FUSION_OFF, **(MOE_TE_ONLY if moe else {}))
    settings.update(cfg.override_transformer_config)
    return settings


def fused_kernel_settings(cfg: EngineConfig, model_config: Any, *, te_spec: bool) -> dict[str, Any]:
    """`kernels.fused_kernels`' fields for `model_config` (a kwargs dict or a provider, with `engine_settings`
    already applied: which fusions apply depends on its final activation and RoPE), less what the overrides set.
    Nothing under TE's spec, whose own kernels are fused."""
    if te_spec:
        return {}
    return fusions.transformer_settings(cfg.kernels.fused_kernels, model_config,
                                        overrides=cfg.override_transformer_config, on_gpu=support.on_gpu(),
                                        kernels=cfg.kernels.fusion_kernels)
