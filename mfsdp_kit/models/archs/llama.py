"""Llama (Llama 2, Llama 3.x and their fine-tunes): the plain pre-norm decoder the other families differ from."""
from .spec import ArchSpec

LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The llama3 rope-scaling parameters megatron applies: RotaryEmbedding passes only `factor` to
`_apply_scaling` (megatron/core/models/common/embeddings/rotary_pos_embedding.py:83-98), whose
other parameters keep these defaults; the Llama bridge maps only `factor`."""

SPEC = ArchSpec(architecture="LlamaForCausalLM", model_type="llama", config_class="LlamaConfig",
                rope_scaling={"llama3": LLAMA3_ROPE_DEFAULTS})
