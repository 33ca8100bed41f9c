"""Models: `gpt` builds a Megatron GPT from sizes; `hf` converts Hugging Face folders."""
from .gpt import GPTSpec, gpt_model_fn, transformer_config  # noqa: F401
from .tiny import tiny, SIZES  # noqa: F401
