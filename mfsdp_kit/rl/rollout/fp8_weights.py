"""FP8 rollout weights (`DecodeConfig.weights="fp8"`): the engine's projections read e4m3 copies of the HF model's
bf16 weights, re-quantized whenever those change.

Which GEMMs: each layer's fused q/k/v, o, fused gate/up and down, in prefill, extend and decode alike
(`decoder.project`), with a fp32 scale per output channel and the activations quantized per token on the fly
(`kernels.fp8`). The LM head stays bf16: its logits are the sampled tokens' log-probs, the rollout's half of the
train-rollout mismatch, and it runs once a step outside the CUDA graphs (at 7 B, 0.5 B of 7.6 B parameters). The
bf16 weights stay too: the weight sync copies into them by name (`backend.refresh`) and each quantization reads
them, so the copies add 1 byte a projection weight (+ 4 bytes an output channel) and a decode step reads about half
the bytes (`step_weight_bytes`).

The naive way quantizes once at load: after the first sync the rollout samples from the old policy. Here
`Fp8Weights.update` runs before every call (`ModelRunner.check_weights`) and re-quantizes when any layer weight was
written since (a `copy_` bumps its version counter; a re-pointed Parameter changes its address). It writes into the
same e4m3 and scale tensors, so the CUDA graphs captured on them replay the new weights without a re-capture.
"""
from __future__ import annotations

import torch

from ...fieldtypes import bad_value
from .kernels.fp8 import E4M3, fits, quantize_rows, scaled_linear

ALLOWED = '"model" (the model\'s own dtype), or "fp8" on a CUDA GPU of compute capability 8.9+ with a dense bf16 model'
"""What `DecodeConfig.weights` allows, as its refusals say it."""


def refuse_device(device: torch.device | str | None = None) -> None:
    """ConfigError naming `weights` unless `device` (None: the current CUDA device) runs FP8 GEMMs: a CUDA GPU of
    compute capability 8.9 or newer (Ada, Hopper: `torch._scaled_mm`'s row-wise scaling)."""
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        raise bad_value("weights", "fp8", f"{ALLOWED} (here: no CUDA device; use \"model\")")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise bad_value("weights", "fp8", f"{ALLOWED} (this GPU is sm{major}{minor}: no FP8 matmul)")


def check(hf_model, *, moe: bool) -> None:
    """ConfigError naming `weights` for a model FP8 weights cannot serve, before anything is made: off a capable GPU
    (`refuse_device`), not bf16, MoE (its experts are the HF module's own GEMMs), or a projection whose sizes are not
    multiples of 16 (`kernels.fp8.fits`)."""
    weight = hf_model.lm_head.weight
    refuse_device(weight.device)
    if weight.dtype != torch.bfloat16:
        raise bad_value("weights", "fp8", f"{ALLOWED} (this model is {weight.dtype}: load it in bfloat16)")
    if moe:
        raise bad_value("weights", "fp8", f"{ALLOWED} (this model routes to experts)")
    for layer in hf_model.model.layers:
        for m in (*layer.self_attn.children(), *layer.mlp.children()):
            if isinstance(m, torch.nn.Linear) and not fits(m.weight):
                raise bad_value("weights", "fp8", f"{ALLOWED} ({tuple(m.weight.shape)}: sizes not multiples of 16)")


def sources(layer) -> dict[tuple[torch.nn.Module, str], tuple[torch.Tensor, torch.Tensor | None]]:
    """(owner, group) -> (bf16 weight, bias) of one layer's four projections, as `decoder.project` finds their
    copies (`owner.kit_<group>_fp8`); the fused ones after `decoder.fuse_projections`."""
    attn, mlp = layer.self_attn, layer.mlp
    return {(attn, "qkv"): (attn.kit_qkv_weight, getattr(attn, "kit_qkv_bias", None)),
            (attn, "o"): (attn.o_proj.weight, attn.o_proj.bias),
            (mlp, "gate_up"): (mlp.kit_gate_up_weight, None),   # as `decoder.mlp` runs it: no bias
            (mlp, "down"): (mlp.down_proj.weight, mlp.down_proj.bias)}


class Fp8Linear:
    """One projection's e4m3 copy (`q` [N, K]) and per-channel scales (`scale` [1, N] fp32), called as its GEMM."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, kernel: bool):
        self.q = torch.empty(weight.shape, dtype=E4M3, device=weight.device)
        self.scale = torch.empty(1, weight.shape[0], dtype=torch.float32, device=weight.device)
        self.kernel = kernel
        """Quantize activations with the Triton kernel (`kernels.fp8.quantize_rows_kernel`), else the torch twin."""
        self.quantize(weight, bias)

    def quantize(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Quantize `weight` into this copy's own tensors (a captured graph reads them in place)."""
        q, scale = quantize_rows(weight.detach())
        self.q.copy_(q)
        self.scale.copy_(scale.reshape(1, -1))
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_linear(x, self.q, self.scale, self.bias, kernel=self.kernel)


class Fp8Weights:
    """The FP8 copies of one model's projections, kept current (module docstring); `ModelRunner` owns one."""

    def __init__(self, hf_model, *, kernel: bool):
        self.model, self.kernel = hf_model, kernel
        self.seen: tuple | None = None
        self.quantized = 0
        """Times the copies were (re)made: once at the first call, then once per weight change."""

    def update(self, *, remake: bool = False) -> bool:
        """Quantize every projection again if a layer weight changed since the last time (or `remake`: the fused
        groups were made anew, so new copies, as the graphs that read the old ones are gone); whether it did."""
        stamp = self.stamp()
        if stamp == self.seen and not remake:
            return False
        with torch.no_grad():
            for layer in self.model.model.layers:
                for (owner, group), (weight, bias) in sources(layer).items():
                    name, old = f"kit_{group}_fp8", getattr(owner, f"kit_{group}_fp8", None)
                    if remake or old is None or old.q.shape != weight.shape:
                        object.__setattr__(owner, name, Fp8Linear(weight, bias, kernel=self.kernel))
                    else:
                        old.quantize(weight, bias)
        self.seen, self.quantized = stamp, self.quantized + 1
        return True

    def stamp(self) -> tuple:
        """Each layer parameter's address and version: any write or re-pointing since changes it."""
        return tuple((p.data_ptr(), _version(p)) for p in self.model.model.layers.parameters())


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:   # an inference-mode tensor keeps no version: never the same, so always re-quantized
        return object()


def step_weight_bytes(hf_model, *, fp8: bool) -> int:
    """Bytes of weights one decode step reads: the layers', the final norm's and the LM head's (not the embedding
    table: a step reads a row of it per sequence); with `fp8` the projections at 1 byte a weight plus a 4-byte scale
    an output channel (the floor of `bench/rollout.py`'s FP8 rows)."""
    tensors = [*hf_model.model.layers.parameters(), *hf_model.model.norm.parameters(), hf_model.lm_head.weight]
    total = sum(p.numel() * p.element_size() for p in tensors)
    if fp8:
        for layer in hf_model.model.layers:
            for m in (*layer.self_attn.children(), *layer.mlp.children()):
                if isinstance(m, torch.nn.Linear):
                    total -= m.weight.numel() * (m.weight.element_size() - 1) - 4 * m.weight.shape[0]
    return total
