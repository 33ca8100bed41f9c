"""Qwen2 and Qwen2.5: Llama's layer with q/k/v biases (no o_proj bias), which its bridge maps."""
from .spec import ArchSpec

SPEC = ArchSpec(architecture="Qwen2ForCausalLM", model_type="qwen2", config_class="Qwen2Config", attention_bias=True)
