"""Qwen3 (dense): Llama's layer with an RMSNorm over each head's q and k, and a head_dim of its own."""
from .spec import ArchSpec, Decoder

SPEC = ArchSpec(architecture="Qwen3ForCausalLM", model_type="qwen3", config_class="Qwen3Config",
                tiny=dict(head_dim=16), decoder=Decoder(qk_norm="head"))
