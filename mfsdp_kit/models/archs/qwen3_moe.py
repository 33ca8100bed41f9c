"""Qwen3-MoE: Qwen3's attention, a routed mixture of experts in every layer (softmax over the top-k router
logits, renormalised)."""
from .spec import MOE, ArchSpec, Decoder, refuse

ARCH = "Qwen3MoeForCausalLM"


def check(config: dict) -> None:
    """The routing and layer layout the bridge builds: an MoE block in every layer, top-k probabilities
    renormalised."""
    if config.get("mlp_only_layers"):
        raise refuse(ARCH, "mlp_only_layers", config["mlp_only_layers"], "[]",
                     "the bridge builds an MoE block in every layer")
    if config.get("decoder_sparse_step", 1) != 1:
        raise refuse(ARCH, "decoder_sparse_step", config["decoder_sparse_step"], "1",
                     "the bridge builds an MoE block in every layer")
    if config.get("norm_topk_prob") is False:
        raise refuse(ARCH, "norm_topk_prob", False, "true",
                     "the bridge routes with softmax over the top-k logits (moe_router_pre_softmax=False), "
                     "which renormalises the top-k probabilities")


SPEC = ArchSpec(architecture=ARCH, model_type="qwen3_moe", config_class="Qwen3MoeConfig",
                tiny=dict(MOE, head_dim=16, decoder_sparse_step=1, norm_topk_prob=True), check=check,
                decoder=Decoder(qk_norm="head", moe=True))
