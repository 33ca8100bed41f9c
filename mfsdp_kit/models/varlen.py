"""Packed rows on a GPU through torch's own variable-length flash attention: one kernel per layer and direction.

A packed row ("thd": [t, heads, hn]) holds several sequences end to end. On CPU `SDPAttention` runs one SDPA
per sequence. On a GPU that is a launch per sequence, layer and direction, and short sequences leave the
kernel's tiles idle; flex_attention's document mask (`models.flex`) takes the row at once but its Triton
kernels ran at about a fifth of cuDNN's FLOP rate (docs/benchmarks.md, packing). torch ships the
varlen flash-attention kernels (FlashAttention-2's `mha_varlen_fwd/bwd`) as `aten::_flash_attention_forward`
/ `_backward`, which take the sequences' bounds `cu_seqlens` directly - the path flash-attn's
`flash_attn_varlen_func` gives verl. SDPA does not expose it for dense tensors, so `VarlenFlash` wraps the
two ops in one autograd function. They are private torch ops: `compat.access.aten` calls them (a registry row, and
a canary test of their argument order). Grouped KV heads go in as they are (the kernel shares them; its backward
sums the group's gradients), dropout replays from the forward's RNG state.

`usable`: CUDA, fp16/bf16, head dim a multiple of 8 up to 256 (elsewhere, as on CPU, one SDPA per sequence).
Attention dropout draws from the default CUDA generator, which megatron's RNG tracker forks around the call.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..compat.access import aten


def usable(query: Tensor) -> bool:
    """Can the varlen flash kernel take this packed row ([t, heads, hn])?"""
    hn = query.shape[-1]
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and hn % 8 == 0 and hn <= 256


class VarlenFlash(torch.autograd.Function):
    """Attention within each sequence of a packed row: q [t, h, hn], k/v [t, h_kv, hn] (h_kv divides h),
    `cu_seqlens` [n + 1] int32 on the row's device, `max_len` the longest sequence (a host int)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_len: int, causal: bool,
                scale: float, dropout_p: float) -> Tensor:
        out, lse, rng, unused = aten.flash_forward(query=q, key=k, value=v, cu_seqlens=cu_seqlens, max_len=max_len,
                                                   dropout_p=dropout_p, causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng, unused)
        ctx.args = (max_len, causal, scale, dropout_p)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        max_len, causal, scale, dropout_p = ctx.args
        dq, dk, dv = aten.flash_backward(grad_out=grad.contiguous(), query=q, key=k, value=v, out=out, logsumexp=lse,
                                         cu_seqlens=cu, max_len=max_len, dropout_p=dropout_p, causal=causal,
                                         rng_state=rng, unused=unused, scale=scale)
        return dq, dk, dv, None, None, None, None, None


def device_bounds(params, device: torch.device) -> Tensor:
    """`params.cu_seqlens_q` (host int32) on `device`, copied once per `params` object (every layer of a
    forward gets the same one) through pinned memory, so no layer waits on the host."""
    cached = getattr(params, "_mfsdp_cu_device", None)
    if cached is None or cached.device != device:
        from ..distributed.runtime import to_device
        cached = to_device(params.cu_seqlens_q.to(torch.int32), device)
        params._mfsdp_cu_device = cached
    return cached


def attention(query: Tensor, key: Tensor, value: Tensor, params, *, causal: bool, scale: float,
              dropout_p: float) -> Tensor:
    """[t, h, hn] attention within each sequence of the packed row `params` describes."""
    cu = device_bounds(params, query.device)
    longest = params.max_seqlen_q or int((params.cu_seqlens_q[1:] - params.cu_seqlens_q[:-1]).max())   # host
    q, k, v = (x.contiguous() for x in (query, key, value))
    return VarlenFlash.apply(q, k, v, cu, int(longest), causal, scale, dropout_p)
