"""`compat.apply("swiglu", kernel=)`: the MLP's fused SwiGLU (`bias_activation_fusion`) in the caller's kernel (the
kit's Triton `models.triton_fusions.swiglu`, with `kernels.fusion_kernels="triton"`: `models.fusions`) instead of
megatron's torch.compile'd functions. The caller hands the kernel in: compat imports nothing of the kit.

megatron-core 0.16.1's MLP calls `bias_swiglu_impl`, imported by name into megatron/core/transformer/mlp.py, whose
`swiglu` / `swiglu_back` are `jit_fuser` (torch.compile) functions. The patch swaps that name in mlp only: calls
without a bias, an fp8-stored input or activation offloading (the kit's models) go to the kernel, the rest
to megatron's function as before. MoE layers keep megatron's compiled functions: the experts call their own
`weighted_bias_swiglu_impl`, and moe/shared_experts.py imports `bias_swiglu_impl` by name too.
`kernel=None` puts megatron's function back (the last model built chooses for the process).
"""
from __future__ import annotations

import functools
from typing import Callable

from ..registry import Patch, record

PATCH = Patch(target="megatron.core.transformer.mlp",
              upstream="megatron/core/transformer/mlp.py:25,204 (bias_swiglu_impl: megatron's jit_fuser SwiGLU, "
                       "torch.compile, the only fused SwiGLU without TE)",
              needed_if="from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl")
"""The module patch `_install` applies (a compat.registry row; tests/compat/test_instance_patches.py)."""


@functools.lru_cache(maxsize=None)
def _routed(kernel: Callable) -> Callable:
    """megatron's `bias_swiglu_impl`, through `kernel` (`y [..., 2 * ffn] -> silu(gate) * up`) where it computes the
    same thing; one function per kernel, so applying it again changes nothing."""
    def bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl as megatrons
        if bias is not None or fp8_input_store or cpu_offload_input:
            return megatrons(input, bias, fp8_input_store, cpu_offload_input)
        return kernel(input)
    return bias_swiglu_impl


def _install(*, kernel: Callable | None = None) -> bool:
    """Point megatron's MLP at the SwiGLU `kernel` (None: megatron's own); returns whether the kernel is in."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    from megatron.core.transformer import mlp
    mlp.bias_swiglu_impl = bias_swiglu_impl if kernel is None else _routed(kernel)
    if kernel is not None:
        record(PATCH)
    return kernel is not None
