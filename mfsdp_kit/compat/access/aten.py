"""torch's private varlen flash-attention ops, called here and nowhere else (models.varlen is their user).

`aten::_flash_attention_forward` / `_flash_attention_backward` (torch 2.13: aten/src/ATen/native/
native_functions.yaml, `_flash_attention_forward` and `_flash_attention_backward`; FlashAttention-2's
`mha_varlen_fwd/bwd`) take a packed row's sequence bounds directly. They are private: no deprecation cycle
protects their argument names or order, and the kit passes their leading arguments positionally.
`FORWARD_ARGS` / `BACKWARD_ARGS` are the order the calls below pass; tests/compat/test_aten.py reads each op's
schema (readable on CPU) and fails when a torch upgrade renames or reorders them, before any GPU run computes
attention with swapped arguments.

Still needed while torch's public varlen attention (`torch.nn.attention.varlen.varlen_attn`, new in torch 2.10)
has no attention dropout, which the kit's packed rows support (`dropout_p`, replayed in backward from the
forward's RNG state). When it gains one, `VarlenFlash` can become a call of it and this module can go.
"""
from __future__ import annotations

import inspect

import torch
from torch import Tensor

from ..registry import Patch, record

FORWARD_ARGS = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
                "return_debug_mask")
"""The positional arguments `flash_forward` passes to aten::_flash_attention_forward, in order (`scale` by name)."""
BACKWARD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
                 "dropout_p", "is_causal", "rng_state", "unused")
"""The positional arguments `flash_backward` passes to aten::_flash_attention_backward, in order (`scale` by name)."""


def public_varlen_lacks_dropout() -> bool:
    """True while torch has no public varlen attention with dropout (then the private ops are still needed)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return True
    return "dropout_p" not in inspect.signature(varlen_attn).parameters


ROW = Patch(target="torch.ops.aten:_flash_attention_forward", package="torch",
            upstream="torch 2.13 aten/src/ATen/native/native_functions.yaml: _flash_attention_forward(query, key, "
                     "value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale) "
                     "and _flash_attention_backward(grad_out, ..., rng_state, unused, *, scale), private ops called "
                     "positionally (no patch: a private API the kit depends on)",
            needed_if=public_varlen_lacks_dropout)
"""The registry row of the dependency, recorded at the first call."""
_recorded = False


def flash_forward(*, query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_len: int, dropout_p: float,
                  causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, logsumexp, rng_state, unused) of the varlen flash forward over the sequences `cu_seqlens` bounds."""
    global _recorded
    if not _recorded:   # once: this runs per layer and micro-batch
        record(ROW)
        _recorded = True
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seqlens, cu_seqlens, max_len, max_len, dropout_p, causal, False, scale=scale)
    return out, lse, rng, unused


def flash_backward(*, grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, logsumexp: Tensor,
                   cu_seqlens: Tensor, max_len: int, dropout_p: float, causal: bool, rng_state: Tensor, unused: Tensor,
                   scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the varlen flash backward, replaying the forward's dropout from `rng_state`."""
    return torch.ops.aten._flash_attention_backward(
        grad_out, query, key, value, out, logsumexp, cu_seqlens, cu_seqlens, max_len, max_len, dropout_p, causal,
        rng_state, unused, scale=scale)
