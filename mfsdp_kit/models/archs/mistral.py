"""Mistral: Llama's layer with a sliding window on every layer, which its bridge maps (one key too many:
`support.megatron_window` makes it exact)."""
from .spec import ArchSpec

SPEC = ArchSpec(architecture="MistralForCausalLM", model_type="mistral", config_class="MistralConfig",
                tiny=dict(sliding_window=None, head_dim=16), sliding_window=True)
