"""Fused RoPE and SwiGLU without Transformer Engine, through torch.compile.

On the local layer spec megatron-core runs RoPE as ~10 separate kernels per tensor (cos/sin casts,
two multiplies, a negation, two concatenations, forward and backward) and SwiGLU as three; at 1.37 B
they took about a fifth of a step (docs/benchmarks.md, throughput, "Fusing RoPE and SwiGLU"). Megatron fuses
both only with TE (`apply_rope_fusion`) or through its `jit_fuser` (`bias_activation_fusion`, which
is `torch.compile` on torch >= 2.2). `EngineConfig(fused_kernels=True)` turns both on:
- SwiGLU: megatron's own `bias_activation_fusion` path (`fusions/fused_bias_swiglu.py`).
- RoPE: megatron calls `rope_utils.fused_apply_rotary_pos_emb(t, freqs, interleaved=)` when
  `apply_rope_fusion` is set; that slot holds TE's kernel, or None without TE. `compat.apply("rope", slots=)` puts
  `rope` in the empty slot: megatron's own unfused `_apply_rotary_pos_emb_bshd`, with cos and sin of `freqs`
  taken once per freqs tensor (megatron's RotaryEmbedding caches freqs per sequence length) instead of
  once per element, and the rotation compiled. Compiling megatron's function whole made one kernel
  that took cos and sin of every element, batch x heads times over each angle: about three times the
  kernel time of this way (bench/fusions.py; docs/benchmarks.md, "levers, fourth set"). The math is
  megatron's: cos and sin rounded to t's dtype as there, then one rounding of the result where eager
  rounds after each op (equal in fp32).
Each fusion applies only where megatron's fused path computes what the unfused one does: SwiGLU
(silu + gated linear unit; megatron's GeGLU fusion uses the tanh gelu, its others exist only with
TE) and plain RoPE (not interleaved, not multi-latent attention).
The first step compiles (Triton on GPU, a C++ compiler on CPU), with a symbolic token dim from the
start (`compat.patches.lazy_compile.compile_tokens_dynamic`): packed rows change their token count every
micro-batch, and torch's default (a static graph first, a dynamic one at the second size) compiled
each kernel twice on the way. One graph for q's layout and one for k's (fewer heads, a strided slice
of megatron's fused qkv output), each direction, whatever the lengths.
`EngineConfig.kernels.fused_kernels="auto"` (the default) turns both on on a GPU where they apply, and
`kernels.fusion_kernels="auto"` (the default) computes them in the kit's Triton kernels on a GPU that runs them
(`support.triton_available`; `models.triton_fusions`: no torch.compile, so a fresh machine's first GRPO update is a few
times faster; docs/benchmarks.md, "The Triton kernels by default"). "torch" keeps the compiled functions of this module.
"""
from __future__ import annotations

import functools

import torch

from .. import compat
from ..compat.patches.lazy_compile import compile_tokens_dynamic, lazy
from .support import triton_available


def _cos_sin(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of `freqs` in `dtype`, as megatron's `_apply_rotary_pos_emb_bshd` makes them; kept on
    the freqs tensor itself (so they die with it), and made again if freqs changed in place. An inference
    tensor keeps no version counter, so its cos and sin are made each call."""
    if freqs.is_inference():
        return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
    key = (freqs._version, dtype)
    cached = getattr(freqs, "_mfsdp_cos_sin", None)
    if cached is None or cached[0] != key:
        cached = (key, torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype))
        freqs._mfsdp_cos_sin = cached
    return cached[1], cached[2]


@lazy(compile_tokens_dynamic)   # one kernel per direction and layout, compiled at the first call
def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The rotation of megatron's `_apply_rotary_pos_emb_bshd` given its cos and sin; dims of `t`
    past cos's last dim pass through."""
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half
    rot_dim = cos.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    return torch.cat((t * cos + _rotate_half(t, interleaved) * sin, t_pass), dim=-1)


@functools.lru_cache(maxsize=None)
def _rotation(kernels: str):
    """The rotation of `kernels` (a config.FUSION_KERNELS value): compiled `_rotate`, or the Triton kernel (imported on
    first use: Triton loads only where it is asked for)."""
    if kernels == "torch":
        return _rotate
    from .triton_fusions import rotate

    def triton_rotate(t, cos, sin, interleaved):
        if interleaved:   # never installed so (`transformer_settings`); a direct call is told
            raise NotImplementedError("the Triton RoPE rotates halves (rotate_half), not interleaved pairs")
        return rotate(t, cos, sin)
    return triton_rotate


def rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, *, kernels: str = "torch") -> torch.Tensor:
    """RoPE on `t` [s, b, heads, head_dim] with `freqs` [s, 1, 1, rot_dim]: megatron's
    `_apply_rotary_pos_emb_bshd`, its rotation one kernel per direction (`kernels`: config.FUSION_KERNELS)."""
    cos, sin = _cos_sin(freqs, t.dtype)
    return _rotation(kernels)(t, cos, sin, interleaved)


def rope_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1,
             cp_rank: int = 0, *, kernels: str = "torch") -> torch.Tensor:
    """RoPE on packed sequences `t` [total, heads, head_dim] (bounds `cu_seqlens`), positions restarting
    at each: megatron's unfused `_apply_rotary_pos_emb_thd` (one rank of context), rotation fused."""
    if cp_size != 1:
        raise NotImplementedError(f"the kit's packed RoPE has no context parallelism (cp_size={cp_size})")
    cos, sin = _packed_cos_sin(cu_seqlens, freqs, t.dtype)
    return _rotation(kernels)(t.unsqueeze(1), cos, sin, False).squeeze(1)


ROPE_SLOTS = {"torch": (rope, rope_thd),
              "triton": (functools.partial(rope, kernels="triton"), functools.partial(rope_thd, kernels="triton"))}
"""What `compat.apply("rope", slots=)` puts in megatron's fused-RoPE slots (padded, packed), per
config.FUSION_KERNELS."""


def swiglu_kernel(kernels: str):
    """What `compat.apply("swiglu", kernel=)` sends megatron's bias-free SwiGLU to for `kernels` (a resolved
    config.FUSION_KERNELS value): the Triton kernel (imported here: Triton loads only where it is asked for), or None
    for "torch" (megatron's own compiled function)."""
    if kernels != "triton":
        return None
    from .triton_fusions import swiglu
    return swiglu


def _packed_cos_sin(cu_seqlens: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype):
    """cos and sin at each packed token's position (restarting per sequence), made once per row: kept on the
    row's `cu_seqlens` tensor, which every layer's q and k receive (a row of n sequences would otherwise cost
    2n slices and 2 concatenations per call, 4 calls a layer)."""
    key = (id(freqs), None if freqs.is_inference() else freqs._version, dtype, freqs.device)
    cached = getattr(cu_seqlens, "_mfsdp_rope", None)
    if cached is not None and cached[0] == key and key[1] is not None:
        return cached[1], cached[2]
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()   # host bounds (`packing.pack`): no sync
    cos, sin = (torch.cat([x[:n] for n in lens]) for x in _cos_sin(freqs, dtype))
    cu_seqlens._mfsdp_rope = (key, cos, sin)
    return cos, sin


def transformer_settings(fused_kernels: bool | str, model_config, *, overrides: dict, on_gpu: bool,
                         kernels: str = "auto") -> dict:
    """TransformerConfig fields for `EngineConfig.kernels.fused_kernels` on `model_config` (the kwargs dict
    of a TransformerConfig, or a Megatron-Bridge provider, with `overrides` already applied), less
    the fields `overrides` sets: explicit overrides win. Installs the fused functions of `kernels`
    (`kernels.fusion_kernels`, as `resolve_kernels` reads it) first: TransformerConfig checks the RoPE slot when
    apply_rope_fusion is set. Both are process-wide slots of megatron's, so the last model built chooses for every
    model of the process. "auto": what applies, on a GPU (`on_gpu`) only; True raises ConfigError when neither
    fusion applies to the model."""
    if not fused_kernels or (fused_kernels == "auto" and not on_gpu):
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
        settings["apply_rope_fusion"] = True
    if not settings and fused_kernels is True:
        raise ConfigError(f"fused_kernels=True is not allowed for this model (activation "
                          f"{getattr(act, '__name__', act)}, gated_linear_unit={glu}, rotary_interleaved="
                          f"{interleaved}, multi_latent_attention={mla}); allowed: False or \"auto\", or True for "
                          f"models with SwiGLU and/or plain RoPE")
    kernels = resolve_kernels(kernels, on_gpu=on_gpu)
    if settings and kernels == "triton":
        check_triton(on_gpu=on_gpu)
    if "apply_rope_fusion" in settings:
        compat.apply("rope", slots=ROPE_SLOTS[kernels])          # compat/patches/rope.py
    if "bias_activation_fusion" in settings:
        compat.apply("swiglu", kernel=swiglu_kernel(kernels))   # compat/patches/swiglu.py
    return {k: v for k, v in settings.items() if k not in overrides}


def triton_runs(*, on_gpu: bool) -> bool:
    """Whether the Triton kernels can run here: on a GPU, `support.triton_available` (Triton, NVIDIA, sm80+);
    off one, for tests, Triton's interpreter (TRITON_INTERPRET=1)."""
    import importlib.util
    import os
    if on_gpu:
        return triton_available()
    return os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


def resolve_kernels(kernels: str, *, on_gpu: bool) -> str:
    """`kernels.fusion_kernels` as run: "auto" is "triton" on a GPU that runs the kernels (`triton_runs`), else
    "torch"; the others are themselves."""
    if kernels != "auto":
        return kernels
    return "triton" if on_gpu and triton_runs(on_gpu=True) else "torch"


def check_triton(*, on_gpu: bool) -> None:
    """ConfigError naming `kernels.fusion_kernels` unless `triton_runs`."""
    from ..config import ConfigError
    if not triton_runs(on_gpu=on_gpu):
        raise ConfigError("kernels.fusion_kernels='triton' is not allowed here: it needs Triton installed and an "
                          "NVIDIA GPU of compute capability 8.0 or newer (or TRITON_INTERPRET=1 on CPU, for tests); "
                          "allowed: 'torch' (torch.compile of the same functions) or 'auto'")
