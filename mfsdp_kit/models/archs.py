"""Tiny models of other people's architectures, written by `transformers` itself: the kit never saw them.

`models.tiny` writes the kit's own model (qwen2/llama, its own tensor values). A researcher arrives
with a folder the kit did not make; `write_tiny(arch, path)` makes one the way that researcher's
would have been made - `AutoModelForCausalLM.from_config(config).save_pretrained(path)` with
transformers' own random init - for any architecture Megatron-Bridge 0.3.1 lists whose config class
this transformers can build offline, plus a word-level tokenizer built with `tokenizers` (no
download, no pad token: like Llama 3's). Two layers, hidden 64, 4 heads / 2 KV heads: seconds on CPU.
"""
from __future__ import annotations

import pathlib

import torch

from ..config import bad_value

BASE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=False,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
"""Shapes every tiny model shares (per-architecture extras in ARCH_CONFIGS)."""

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

ARCH_CONFIGS: dict[str, tuple[str, dict]] = {
    # architecture: (transformers config class, extra config fields)
    "Qwen2ForCausalLM": ("Qwen2Config", {}),
    "LlamaForCausalLM": ("LlamaConfig", {}),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(head_dim=16)),
    "MistralForCausalLM": ("MistralConfig", dict(sliding_window=None, head_dim=16)),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(MOE, head_dim=16, decoder_sparse_step=1, norm_topk_prob=True)),
    # OLMoE's QK norm spans all heads; Megatron's OLMoE attention supports only as many KV heads as heads
    "OlmoeForCausalLM": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                             num_key_value_heads=4)),
    "GemmaForCausalLM": ("GemmaConfig", dict(head_dim=16)),
    "Gemma2ForCausalLM": ("Gemma2Config", dict(head_dim=16, sliding_window=32)),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=32)),
    "NemotronForCausalLM": ("NemotronConfig", dict(head_dim=16, norm_eps=1e-6)),
    "DeepseekV2ForCausalLM": ("DeepseekV2Config", dict(MOE, n_routed_experts=4, kv_lora_rank=16, q_lora_rank=None,
                                                       qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                                       first_k_dense_replace=1, n_shared_experts=1)),
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", dict(MOE, n_routed_experts=4, kv_lora_rank=16, q_lora_rank=None,
                                                       qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                                       first_k_dense_replace=1, n_shared_experts=1, n_group=1,
                                                       topk_group=1)),
    "Glm4MoeForCausalLM": ("Glm4MoeConfig", dict(MOE, n_routed_experts=4, first_k_dense_replace=1, n_shared_experts=1,
                                                 head_dim=16, n_group=1, topk_group=1)),
    "GptOssForCausalLM": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                               sliding_window=32)),
    "Qwen3NextForCausalLM": ("Qwen3NextConfig", dict(MOE, head_dim=16)),
}
"""Architectures a tiny model can be written for. The others Megatron-Bridge lists are
vision-language models (`*ForConditionalGeneration`, `NemotronH_Nano_VL_V2`) or need remote code
(`DeciLMForCausalLM`), or have no config class in transformers 4.57 (`NemotronHForCausalLM`)."""

SPECIAL = ("<unk>", "<s>", "</s>")
"""Tokenizer ids 0..2; the remaining ids are words w3, w4, ... No pad token."""


def hf_config(arch: str, *, vocab_size: int = 256, **overrides):
    """The transformers config of a tiny `arch` model (fp32, untied embeddings)."""
    import transformers
    if arch not in ARCH_CONFIGS:
        raise bad_value("arch", arch, ", ".join(ARCH_CONFIGS))
    cls_name, extra = ARCH_CONFIGS[arch]
    config = getattr(transformers, cls_name)(**{**BASE, **extra, "vocab_size": vocab_size, **overrides})
    config.architectures = [arch]
    config.torch_dtype = torch.float32
    return config


def build_tokenizer(vocab_size: int):
    """A word-level `PreTrainedTokenizerFast` over `vocab_size` ids (whitespace split, no pad token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = list(SPECIAL) + [f"w{i}" for i in range(len(SPECIAL), vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def write_tiny(arch: str, path, *, vocab_size: int = 256, seed: int = 0, **overrides) -> pathlib.Path:
    """Write an HF folder for a tiny `arch` model with transformers' own random init (seeded)."""
    import transformers
    config = hf_config(arch, vocab_size=vocab_size, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = pathlib.Path(path)
    model.save_pretrained(path)
    build_tokenizer(vocab_size).save_pretrained(path)
    return path
