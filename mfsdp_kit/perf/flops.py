"""FLOPs per token and model FLOPs utilisation (MFU), PaLM's accounting (Chowdhery et al. 2022, app. B).

    FLOPs/token = 6 * N  +  12 * L * H * S
    N = parameters that take part in a matmul = transformer layers + final norm + output layer
        (H * V); the input embedding table is a lookup and is EXCLUDED.
    6 * N: 2 FLOP per multiply-add, x3 for forward + backward (grad of inputs and of weights).
    12 * L * H * S: attention scores and weighted sum (2 matmuls * 2 FLOP * S * H per token per
        layer, x3 for forward + backward), full S x S (causal masking not discounted).
    MFU = tokens/s/GPU * FLOPs/token / peak FLOP/s of one GPU.
MFU, not HFU: a recomputed forward costs time but is not counted (the model did no more work).
For the 1.7b spec (L 24, H 2048, S 2048, V 32768): N = 1.30 B, 6 N = 7.80 GFLOP, 12 L H S =
1.21 GFLOP, so 9.01 GFLOP/token; at 50 % MFU an H200 trains 989e12 * 0.5 / 9.01e9 = 54.9 k tokens/s.
"""
from __future__ import annotations

from dataclasses import replace

from ..models.gpt import GPTSpec

PEAK_FLOPS_PER_GPU = 989e12
"""H100/H200 SXM, dense bf16 (no sparsity), FLOP/s."""


def matmul_params(spec: GPTSpec) -> int:
    """N of the FLOP formula: every parameter except the input embedding table (V * H)."""
    return spec.param_count() - spec.vocab_size * spec.hidden_size


def layer_params(spec: GPTSpec) -> int:
    """Parameters of one transformer layer (= one Megatron-FSDP unit)."""
    return (spec.param_count() - replace(spec, num_layers=0).param_count()) // spec.num_layers


def flops_per_token(spec: GPTSpec) -> int:
    """Training FLOPs per token at sequence length spec.seq_len_tokens: 6 N + 12 L H S."""
    return 6 * matmul_params(spec) + 12 * spec.num_layers * spec.hidden_size * spec.seq_len_tokens


def mfu(tokens_per_s_per_gpu: float, spec: GPTSpec, *, peak_flops: float = PEAK_FLOPS_PER_GPU) -> float:
    """Model FLOPs utilisation: the fraction of `peak_flops` the model's own arithmetic uses."""
    return tokens_per_s_per_gpu * flops_per_token(spec) / peak_flops
