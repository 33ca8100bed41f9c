"""OLMoE: an RMSNorm over all heads' q (and all k) at once, a routed mixture of experts (softmax before top-k, not
renormalised), optional q/k/v clipping.

Its bridge maps only Transformer Engine's grouped experts (megatron/bridge/models/olmoe/olmoe_bridge.py:98-145):
the SequentialMLP expert names of the local spec get the mappings the Qwen3-MoE bridge has (`Bridge.mappings`;
their numbering under expert parallelism is `compat.patches.experts`). Its QK norm is the bridge's own attention
class, kept on the local spec (`Bridge.local_attention`).
"""
from .spec import ArchSpec, Bridge, Decoder, refuse

ARCH = "OlmoeForCausalLM"


def check(config: dict) -> None:
    """The routing the bridge builds (softmax before top-k, no renormalisation), no clipping, K normalised over
    num_attention_heads heads."""
    if config.get("norm_topk_prob"):
        raise refuse(ARCH, "norm_topk_prob", True, "false",
                     "the bridge routes with softmax before top-k (moe_router_pre_softmax=True), without renormalising")
    if config.get("clip_qkv") is not None:
        raise refuse(ARCH, "clip_qkv", config["clip_qkv"], "null", "megatron's attention does not clip q/k/v")
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads", heads)
    if kv != heads:
        raise refuse(ARCH, "num_key_value_heads", kv, f"{heads} (= num_attention_heads)",
                     "the bridge's OLMoE attention normalises K over num_attention_heads heads")


EXPERTS = "decoder.layers.*.mlp.experts.local_experts.*"
HF_EXPERTS = "model.layers.*.mlp.experts.*"

SPEC = ArchSpec(
    architecture=ARCH, model_type="olmoe", config_class="OlmoeConfig",
    # QK norm spans all heads, and the bridge's OLMoE attention supports only as many KV heads as heads
    tiny=dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32, num_key_value_heads=4),
    check=check,
    no_tensor_parallel="its QK norm spans all heads and the bridge's OLMoE attention normalises only the heads of "
                       "its own tensor-parallel rank",
    bridge=Bridge(mappings=(
        ("GatedMLPMapping", dict(megatron_param=f"{EXPERTS}.linear_fc1.weight", gate=f"{HF_EXPERTS}.gate_proj.weight",
                                 up=f"{HF_EXPERTS}.up_proj.weight")),
        ("AutoMapping", dict(megatron_param=f"{EXPERTS}.linear_fc2.weight", hf_param=f"{HF_EXPERTS}.down_proj.weight"))),
        local_attention=True),
    decoder=Decoder(qk_norm="heads", moe=True))
