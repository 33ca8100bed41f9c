"""`compat.apply("swiglu", kernels=)`: the MLP's fused SwiGLU (`bias_activation_fusion`) in the kit's Triton kernels
(`models.triton_fusions.swiglu`) instead of megatron's torch.compile'd functions, with
`kernels.fusion_kernels="triton"` (`models.fusions.transformer_settings`).

megatron-core 0.16.1's MLP calls `bias_swiglu_impl`, imported by name into megatron/core/transformer/mlp.py, whose
`swiglu` / `swiglu_back` are `jit_fuser` (torch.compile) functions. The patch swaps that name in mlp only: calls
without a bias, an fp8-stored input or activation offloading (the kit's models) go to the Triton kernels, the rest
to megatron's function as before. MoE layers keep megatron's compiled functions: the experts call their own
`weighted_bias_swiglu_impl`, and moe/shared_experts.py imports `bias_swiglu_impl` by name too.
`kernels="torch"` puts megatron's function back (the last model built chooses for the process).
"""
from __future__ import annotations

from ..registry import Patch, record

PATCH = Patch(target="megatron.core.transformer.mlp",
              upstream="megatron/core/transformer/mlp.py:25,204 (bias_swiglu_impl: megatron's jit_fuser SwiGLU, "
                       "torch.compile, the only fused SwiGLU without TE)",
              needed_if="from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl")
"""The module patch `_install` applies (a compat.registry row; tests/compat/test_instance_patches.py)."""


def _triton_bias_swiglu_impl(input, bias, fp8_input_store=False, cpu_offload_input=False):
    """megatron's `bias_swiglu_impl`, through the Triton kernels where they compute the same thing."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    if bias is not None or fp8_input_store or cpu_offload_input:
        return bias_swiglu_impl(input, bias, fp8_input_store, cpu_offload_input)
    from ...models.triton_fusions import swiglu
    return swiglu(input)


def _install(kernels: str = "torch") -> bool:
    """Point megatron's MLP at the SwiGLU of `kernels` ("torch": megatron's own | "triton"); returns whether the
    Triton one is in."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    from megatron.core.transformer import mlp
    mlp.bias_swiglu_impl = _triton_bias_swiglu_impl if kernels == "triton" else bias_swiglu_impl
    if kernels == "triton":
        record(PATCH)
    return kernels == "triton"
