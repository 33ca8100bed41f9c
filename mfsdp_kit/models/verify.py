"""Is the loaded Megatron model the HF model? A short forward of both on the same tokens.

A conversion can go wrong without any error: a config field the bridge does not map (rope
scaling parameters, a window), a weight split along the wrong dimension, a norm that adds one.
Then training runs on a different model and nothing says so. `verify(model)` runs the HF
reference (transformers, the same folder) and the loaded Megatron chunks on a few fixed token
sequences and reports the largest logit difference, absolute and relative to the logit scale
(the largest |logit| of the reference): fp32 conversions agree to ~1e-6 relative; bf16 to ~1e-2.

Cost: every rank builds the HF model once in host memory (its full size in the folder's dtype,
~4 GB for a 2 B bf16 model) and runs `sequences` x `seq_len_tokens` tokens through both models:
seconds for small models, the load time for ~2 B. Collective: with Megatron-FSDP or TP, every
rank must call it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..distributed.introspect import torch_dtype
from .vocab import full_logits

DEFAULT_TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 1e-2}
"""Largest |Megatron - HF| / logit scale accepted per compute dtype."""


@dataclass
class Verification:
    """Logits of the loaded model against transformers' on the same folder and tokens."""

    max_abs_diff: float
    """max |logits_megatron - logits_hf| over every sequence, position and vocabulary id."""
    logit_scale: float
    """max |logits_hf|: what the difference is relative to."""
    relative: float
    """max_abs_diff / logit_scale."""
    tolerance: float
    """The relative difference accepted for this dtype (DEFAULT_TOLERANCE)."""
    tokens_shape: tuple
    """[sequences, seq_len_tokens] that were compared."""

    @property
    def ok(self) -> bool:
        return self.relative <= self.tolerance

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}

    def __str__(self) -> str:
        return (f"verify: max|logits - HF| = {self.max_abs_diff:.3g} ({self.relative:.2g} of the logit scale "
                f"{self.logit_scale:.3g}; tolerance {self.tolerance:g}): {'ok' if self.ok else 'MISMATCH'}")


class VerificationError(RuntimeError):
    """The loaded Megatron model's logits differ from transformers' beyond the tolerance."""


def fixed_tokens(vocab_size: int, *, sequences: int = 2, seq_len_tokens: int = 16, seed: int = 5) -> torch.Tensor:
    """Deterministic token ids in [0, vocab_size): the same on every rank and every run."""
    return torch.randint(0, vocab_size, (sequences, seq_len_tokens), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_logits(hf_path, tokens: torch.Tensor, *, dtype: str = "fp32", trust_remote_code: bool = False) -> torch.Tensor:
    """transformers' fp32 logits for `tokens` (the reference), on the tokens' device."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf_path), dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code).to(tokens.device).eval()
    out = model(tokens).logits.float()
    del model
    return out


def verify(model, *, tokens: torch.Tensor | None = None, sequences: int = 2, seq_len_tokens: int = 16,
           tolerance: float | None = None, strict: bool = False) -> Verification:
    """Compare a loaded `HFModel`'s logits with transformers' on its own folder.

    `tokens` [batch, seq] default to `fixed_tokens`. With `strict`, a difference beyond the
    tolerance raises `VerificationError` instead of being only reported.
    """
    vocab = model.vocab_size
    if tokens is None:
        tokens = fixed_tokens(vocab, sequences=sequences, seq_len_tokens=seq_len_tokens)
    device = next(model.chunks[0].parameters()).device
    tokens = tokens.to(device if device.type != "meta" else "cpu")
    ref = hf_logits(model.hf_path, tokens, dtype=model.cfg.dtype)
    mine = full_logits(model.chunks, tokens, vocab_size=vocab)   # what generate.logits returns for whole rows
    max_abs = (mine - ref).abs().max().item()
    scale = ref.abs().max().item()
    result = Verification(max_abs_diff=max_abs, logit_scale=scale, relative=max_abs / max(scale, 1e-30),
                          tolerance=DEFAULT_TOLERANCE[model.cfg.dtype] if tolerance is None else tolerance,
                          tokens_shape=tuple(tokens.shape))
    if strict and not result.ok:
        raise VerificationError(f"{model.hf_path}: {result}. The Megatron model is not the HF model: a config field "
                                "the conversion does not reproduce, or a weight converted wrongly")
    return result
