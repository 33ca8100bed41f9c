"""The architectures Megatron-Bridge 0.3.1 lists that this install refuses by name, each with the reason (what it
would need) and, where transformers builds its config offline, a tiny config to show the refusal on.

The others Megatron-Bridge lists are vision-language models (`*ForConditionalGeneration`, `NemotronH_Nano_VL_V2`),
need remote code (`DeciLMForCausalLM`) or have no config class in transformers 4.57 (`NemotronHForCausalLM`): no
tiny config; `check_folder` refuses them by the name in config.json alone.
"""
from .spec import MOE, Refused

_NO_TE = "this install has no Transformer Engine"
_VL = ("a vision-language model: the kit builds megatron's GPTModel (text tokens in, logits out) and "
       "its data and generation paths carry no images")
_UNVERIFIED = ("not verified to reproduce HF logits on megatron's local (no-TE) spec; the kit refuses it rather "
               "than risk training a silently different model")
_MLA = dict(MOE, n_routed_experts=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, first_k_dense_replace=1, n_shared_experts=1)

REFUSALS = (
    Refused(architecture="GemmaForCausalLM", config_class="GemmaConfig", tiny=dict(head_dim=16),
            reason="RMSNorm with zero-centered gamma (x * (1 + w), layernorm_zero_centered_gamma) is implemented only "
                   f"by TE's norms, and {_NO_TE} (megatron's torch norm asserts)"),
    Refused(architecture="Gemma2ForCausalLM", config_class="Gemma2Config", tiny=dict(head_dim=16, sliding_window=32),
            reason="zero-centered-gamma RMSNorm, attention-logit soft-capping and alternating sliding windows come "
                   f"from the bridge's Gemma2 layer spec, built on TE modules, and {_NO_TE}"),
    Refused(architecture="Gemma3ForCausalLM", config_class="Gemma3TextConfig",
            tiny=dict(head_dim=16, sliding_window=32),
            reason="zero-centered-gamma RMSNorm, per-layer local/global RoPE and sliding windows come from the "
                   f"bridge's Gemma3 layer spec, built on TE modules, and {_NO_TE}"),
    Refused(architecture="NemotronForCausalLM", config_class="NemotronConfig", tiny=dict(head_dim=16, norm_eps=1e-6),
            reason=f"LayerNorm with zero-centered gamma (layernorm1p) is implemented only by TE's norms, and {_NO_TE}"),
    Refused(architecture="NemotronHForCausalLM",
            reason="hybrid Mamba layers need the mamba_ssm and causal_conv1d kernels (and triton), not installed "
                   "here"),
    Refused(architecture="Qwen3NextForCausalLM", config_class="Qwen3NextConfig", tiny=dict(MOE, head_dim=16),
            reason="gated DeltaNet linear attention needs the flash-linear-attention (fla) triton kernels and TE, not "
                   "installed here"),
    Refused(architecture="GptOssForCausalLM", config_class="GptOssConfig",
            tiny=dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=32),
            reason="attention sinks (softmax_type='learnable') and YaRN-scaled sliding windows: megatron's local "
                   "attention and the kit's SDPA attention implement neither exactly without TE"),
    Refused(architecture="DeepseekV2ForCausalLM", config_class="DeepseekV2Config", tiny=_MLA,
            reason=f"multi-latent attention (MLA) with MoE: {_UNVERIFIED}"),
    Refused(architecture="DeepseekV3ForCausalLM", config_class="DeepseekV3Config",
            tiny=dict(_MLA, n_group=1, topk_group=1),
            reason=f"multi-latent attention (MLA), MoE with grouped routing and MTP: {_UNVERIFIED}"),
    Refused(architecture="Glm4MoeForCausalLM", config_class="Glm4MoeConfig",
            tiny=dict(MOE, n_routed_experts=4, first_k_dense_replace=1, n_shared_experts=1, head_dim=16, n_group=1,
                      topk_group=1),
            reason=f"MoE with shared experts, grouped routing and dense first layers: {_UNVERIFIED}"),
    Refused(architecture="DeciLMForCausalLM",
            reason="Llama-Nemotron's heterogeneous blocks need the model's remote code (trust_remote_code) and a "
                   f"per-layer spec: {_UNVERIFIED}"),
    *(Refused(architecture=name, reason=_VL) for name in (
        "Gemma3ForConditionalGeneration", "Glm4vMoeForConditionalGeneration", "Mistral3ForConditionalGeneration",
        "NemotronH_Nano_VL_V2", "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration")),
)
"""Every refused architecture, once."""
