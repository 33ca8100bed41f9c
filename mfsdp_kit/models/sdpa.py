"""Core attention on `torch.nn.functional.scaled_dot_product_attention` for megatron's local spec.

megatron's `DotProductAttention` (the local spec's core attention, no Transformer Engine)
computes attention the naive way: it materialises the [b, heads, sq, sk] score matrix, runs a
separate softmax and keeps the probabilities for backward - O(s^2) memory per layer and three
kernels where one would do. `SDPAttention` takes the same constructor and forward arguments
and calls torch's SDPA instead, which dispatches to a fused kernel (flash / memory-efficient /
cuDNN on GPU) that never stores the score matrix: at 1.7 B params, 1.7x the throughput at half the
peak memory (measured: docs/benchmarks.md, "Figures that used to live in docstrings").

What it keeps equal to `DotProductAttention` (megatron-core 0.16.1,
megatron/core/transformer/dot_product_attention.py):
- heads per tensor-parallel partition and the [sq, b, np, hn] -> [sq, b, hp] layouts;
- the softmax scale: `softmax_scale` (the Attention module passes `config.softmax_scale`) or
  1/sqrt(hn); `apply_query_key_layer_scaling` divides the scores by layer_number and the softmax
  multiplies them back, so the net scale is unchanged - SDPA gets the net scale;
- masks: megatron's boolean mask is True = masked OUT (SDPA's is True = attend); an explicit
  mask is used as given, with no causal mask added (as megatron's torch softmax does); a causal
  layer without a mask is `is_causal=True`; one query row (sq == 1) attends to everything;
- dropout `attention_dropout` (arg, else config) in training only, under megatron's RNG tracker.
Packed sequences (`packed_seq_params`, megatron's "thd" layout that `mfsdp_kit.train.packing` builds): on a GPU in
fp16/bf16 one varlen flash-attention call per layer (`models.varlen`), elsewhere one SDPA per sequence; causal
within each sequence either way. Not supported (raise NotImplementedError naming the feature): attention
bias, sliding-window attention, context parallelism, softmax_type other than "vanilla".
Numerics: a fully masked row gives NaN-free zeros in SDPA but a uniform average in megatron
(which fills -10000, not -inf); rows with at least one visible key agree.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from . import varlen


def _unsupported(feature: str, hint: str = "use the TE spec (TEDotProductAttention)") -> NotImplementedError:
    return NotImplementedError(f"SDPAttention does not support {feature}; {hint}")


def per_sequence(query: Tensor, key: Tensor, value: Tensor, lens: list[int], *, causal: bool, scale: float,
                 dropout_p: float = 0.0) -> Tensor:
    """Attention within each sequence of a packed row ([t, heads, hn], sequence lengths `lens`): one SDPA per
    sequence, grouped KV heads as they are (fewer key than query heads); [t, heads, hn] out."""
    outs = []
    for q, k, v in zip(query.split(lens), key.split(lens), value.split(lens)):
        q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))   # [L, h, hn] -> [1, h, L, hn]
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal and q.shape[2] > 1,
                                             scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        outs.append(out[0].permute(1, 0, 2))
    return torch.cat(outs)


class SDPAttention(MegatronModule):
    """Drop-in for megatron's `DotProductAttention`: [sq, b, np, hn] q/k/v -> [sq, b, np * hn]."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise _unsupported(f"context parallelism (context_parallel_size={config.context_parallel_size})")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise _unsupported(f"sliding-window attention (window_size={config.window_size})")
        if config.softmax_type != "vanilla":
            raise _unsupported(f"softmax_type={config.softmax_type!r}", "use softmax_type='vanilla'")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        tp = self.tp_group.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        # megatron: scores * (scale / layer_number) in the matmul, * layer_number in the fp32
        # softmax (query-key layer scaling) - the product is the scale below.
        self.softmax_scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head) if softmax_scale is None \
            else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params=None) -> Tensor:
        if attention_bias is not None:
            raise _unsupported("attention_bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, attention_mask, packed_seq_params,
                                attn_mask_type or self.attn_mask_type)
        sq, b, sk = query.shape[0], query.shape[1], key.shape[0]
        # [s, b, heads, hn] -> [b, heads, s, hn] (views; SDPA needs only a unit last-dim stride)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        mask, is_causal = self._sdpa_mask(attention_mask, attn_mask_type or self.attn_mask_type, sq, sk)
        if groups > 1 and mask is not None:
            # The fused kernels that take a mask (memory-efficient) do not take enable_gqa;
            # expanding KV keeps SDPA off its unfused math fallback.
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        dropout_p = self.dropout_p if self.training else 0.0
        with self._rng(dropout_p):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                                 scale=self.softmax_scale,
                                                 enable_gqa=groups > 1 and mask is None)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor], params,
                mask_type: AttnMaskType) -> Tensor:
        """Packed sequences ("thd": [t, heads, hn], megatron squeezed the batch of one), causal within each, so
        no token sees another sequence and no score is computed across two: one varlen flash call where
        `varlen.usable`, else one SDPA per sequence. The sequences' bounds are `params.cu_seqlens_q`
        (`packing.pack` keeps them on the host: no sync)."""
        if params.qkv_format != "thd" or attention_mask is not None:
            raise _unsupported(f"packed sequences as {params.qkv_format!r} or with an attention_mask",
                               "pack with mfsdp_kit.train.packing (qkv_format='thd', no mask)")
        dropout_p = self.dropout_p if self.training else 0.0
        causal = mask_type == AttnMaskType.causal
        if varlen.usable(query):
            with self._rng(dropout_p):
                out = varlen.attention(query, key, value, params, causal=causal, scale=self.softmax_scale,
                                       dropout_p=dropout_p)
            return out.reshape(query.shape[0], self.hidden_size_per_partition)
        cu = params.cu_seqlens_q.tolist()
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        with self._rng(dropout_p):
            out = per_sequence(query, key, value, lens, causal=causal, scale=self.softmax_scale, dropout_p=dropout_p)
        return out.reshape(query.shape[0], self.hidden_size_per_partition)

    @staticmethod
    def _sdpa_mask(attention_mask: Optional[Tensor], mask_type: AttnMaskType, sq: int, sk: int):
        """(SDPA boolean mask or None, is_causal) for megatron's (mask, mask type)."""
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise TypeError(f"attention_mask dtype {attention_mask.dtype}: megatron's local attention takes "
                                "a boolean mask with True = masked out")
            return ~attention_mask, False  # megatron: True = masked out; SDPA: True = attend
        if mask_type == AttnMaskType.causal and sq > 1:
            if sq != sk:
                raise _unsupported(f"a causal mask with sq={sq} != sk={sk} (bottom-right alignment)")
            return None, True
        return None, False

    def _rng(self, dropout_p: float):
        """megatron forks its model-parallel RNG stream for attention dropout (distinct per TP rank)."""
        if dropout_p > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """No parameters (vanilla softmax only): nothing to checkpoint."""
        return {}
