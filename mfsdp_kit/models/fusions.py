"""Fused RoPE and SwiGLU without Transformer Engine, through torch.compile.

On the local layer spec megatron-core runs RoPE as ~10 separate kernels per tensor (cos/sin casts,
two multiplies, a negation, two concatenations, forward and backward) and SwiGLU as three; on a
1.37 B GPT on H200 they took ~140 ms of a 700 ms step (docs/benchmarks.md, profile). Megatron fuses
both only with TE (`apply_rope_fusion`) or through its `jit_fuser` (`bias_activation_fusion`, which
is `torch.compile` on torch >= 2.2). `EngineConfig(fused_kernels=True)` turns both on:
- SwiGLU: megatron's own `bias_activation_fusion` path (`fusions/fused_bias_swiglu.py`).
- RoPE: megatron calls `rope_utils.fused_apply_rotary_pos_emb(t, freqs, interleaved=)` when
  `apply_rope_fusion` is set; that slot holds TE's kernel, or None without TE. `install()` puts
  megatron's own unfused `_apply_rotary_pos_emb_bshd`, compiled, in the empty slot, so the
  math is megatron's and only the kernel count changes (equal in fp32; in bf16 the compiled kernel
  rounds once where eager rounds after each op).
Each fusion applies only where megatron's fused path computes what the unfused one does: SwiGLU
(silu + gated linear unit; megatron's GeGLU fusion uses the tanh gelu, its others exist only with
TE) and plain RoPE (not interleaved, not multi-latent attention).
The first step compiles (Triton on GPU, a C++ compiler on CPU); a new sequence length compiles
once more, then shapes are dynamic.
"""
from __future__ import annotations

import torch

_compiled_rope = None


def rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """RoPE on `t` [s, b, heads, head_dim] with `freqs` [s, 1, 1, rot_dim]: megatron's
    `_apply_rotary_pos_emb_bshd`, compiled into one fused kernel per direction."""
    global _compiled_rope
    if _compiled_rope is None:
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
        _compiled_rope = torch.compile(_apply_rotary_pos_emb_bshd)
    return _compiled_rope(t, freqs, rotary_interleaved=interleaved)


def install() -> bool:
    """Fill megatron's fused-RoPE slot with `rope` when TE left it empty; returns whether it did."""
    from megatron.core.models.common.embeddings import rope_utils
    if rope_utils.fused_apply_rotary_pos_emb is not None:
        return rope_utils.fused_apply_rotary_pos_emb is rope
    rope_utils.fused_apply_rotary_pos_emb = rope
    return True


def transformer_settings(fused_kernels: bool, model_config, *, overrides: dict) -> dict:
    """TransformerConfig fields for `EngineConfig.fused_kernels` on `model_config` (the kwargs dict
    of a TransformerConfig, or a Megatron-Bridge provider, with `overrides` already applied), less
    the fields `overrides` sets: explicit overrides win. Installs the RoPE kernel first:
    TransformerConfig checks the slot when apply_rope_fusion is set. Raises ConfigError when neither
    fusion applies to the model."""
    if not fused_kernels:
        return {}
    import torch.nn.functional as F
    from ..config import ConfigError
    get = model_config.get if isinstance(model_config, dict) else lambda k, d=None: getattr(model_config, k, d)
    act, glu = get("activation_func"), get("gated_linear_unit", False)
    interleaved, mla = get("rotary_interleaved", False), get("multi_latent_attention", False)
    settings = {}
    if act is F.silu and glu:
        settings["bias_activation_fusion"] = True
    if not interleaved and not mla:
        install()
        settings["apply_rope_fusion"] = True
    if not settings:
        raise ConfigError(f"fused_kernels=True is not allowed for this model (activation "
                          f"{getattr(act, '__name__', act)}, gated_linear_unit={glu}, rotary_interleaved="
                          f"{interleaved}, multi_latent_attention={mla}); allowed: False, or True for models "
                          f"with SwiGLU and/or plain RoPE")
    return {k: v for k, v in settings.items() if k not in overrides}
