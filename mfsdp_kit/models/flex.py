"""Packed rows through torch's `flex_attention`: one compiled kernel over a document block mask.

`SDPAttention` runs a packed row as one varlen flash call on a GPU (`models.varlen`, the faster of the two
there: docs/benchmarks.md, packing) and as one SDPA per sequence on CPU. `flex_attention` takes
the whole row at once with a `BlockMask` (torchtitan's document masking): a query attends to a key iff both
belong to the same sequence and the key is not later; blocks (128 x 128 on GPU) that cross sequences are
skipped, so the FLOPs stay close to the per-sequence sum. The mask is built once per micro-batch (the first
layer builds it and keeps it on the `PackedSeqParams` every layer receives).

`EngineConfig(attention_backend="flex")`: padded batches still take `SDPAttention`'s path; only packed
rows change. Limits (torch 2.13): flex_attention has no backward on CPU ("FlexAttention does not support
backward on CPU"), so training with it needs a GPU; forwards without grad run on CPU through inductor's
C++ path (eagerly where inductor has no flex kernel for the CPU: `flex_kernel`). No attention dropout (flex
has none): refused when training with it.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..compat.patches.lazy_compile import lazy
from .sdpa import SDPAttention, _unsupported


def eager_flex(q: Tensor, k: Tensor, v: Tensor, block_mask, scale: float, enable_gqa: bool) -> Tensor:
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


compiled_flex = lazy(torch.compile)(eager_flex, dynamic=True)   # row lengths vary: one dynamic-shape compile


def flex_kernel(device: torch.device):
    """The compiled flex_attention, or torch's eager one (its reference math: slower, the same numbers) on a CPU
    that inductor has no flex kernel for: without AVX2, under ATEN_CPU_CAPABILITY=default, on macOS
    (`check_cpu_supported`, torch 2.13; compiling there raises "torch.compile on current platform is not
    supported for CPU")."""
    if device.type != "cpu":
        return compiled_flex
    try:
        from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported
    except ImportError:   # another torch: compile, as before this check existed
        return compiled_flex
    return compiled_flex if check_cpu_supported() else eager_flex


def block_mask(params, device: torch.device, *, causal: bool):
    """The document mask of the row `params.cu_seqlens_q` describes, made once per `params` object."""
    cached = getattr(params, "_mfsdp_block_mask", None)
    if cached is not None and cached[0] == (device, causal):
        return cached[1]
    from torch.nn.attention.flex_attention import create_block_mask
    cu = params.cu_seqlens_q.long()
    total = int(cu[-1])
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1]).to(device)

    def same_sequence(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv) if causal else doc[q] == doc[kv]
    mask = create_block_mask(same_sequence, None, None, total, total, device=device)
    params._mfsdp_block_mask = ((device, causal), mask)
    return mask


class FlexAttention(SDPAttention):
    """`SDPAttention` whose packed rows go through one `flex_attention` call (module docstring)."""

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor], params,
                mask_type) -> Tensor:
        from megatron.core.transformer.enums import AttnMaskType
        if params.qkv_format != "thd" or attention_mask is not None:
            raise _unsupported(f"packed sequences as {params.qkv_format!r} or with an attention_mask",
                               "pack with mfsdp_kit.train.packing (qkv_format='thd', no mask)")
        if self.training and self.dropout_p > 0:
            raise _unsupported(f"attention dropout ({self.dropout_p}) with flex_attention",
                               "use attention_backend='sdpa'")
        if query.device.type == "cpu" and torch.is_grad_enabled() and query.requires_grad:
            raise _unsupported("training with flex_attention on CPU (torch has no CPU backward for it)",
                               "use attention_backend='sdpa' on CPU")
        mask = block_mask(params, query.device, causal=mask_type == AttnMaskType.causal)
        q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))   # [t, h, hn] -> [1, h, t, hn]
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        out = flex_kernel(query.device)(q, k, v, mask, self.softmax_scale, groups > 1)
        return out[0].permute(1, 0, 2).reshape(query.shape[0], self.hidden_size_per_partition)


def core_attention(backend: str):
    """The core-attention class of `EngineConfig.kernels.attention_backend` "sdpa" or "flex"."""
    return {"sdpa": SDPAttention, "flex": FlexAttention}[backend]
