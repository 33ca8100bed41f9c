"""Megatron-Core 0.16.1's gradient norm without TE or Apex waits on the GPU once per parameter.

Without TE/Apex, optimizer/clip_grads.py:35-43 falls back to `megatron.core.utils.local_multi_tensor_l2_norm`
(utils.py:1200-1208), which builds `torch.tensor(l2)` from a list of per-parameter 0-dim norms on the GPU:
one device-to-host copy, and so one `cudaStreamSynchronize`, per gradient tensor, every step (measured on
1 H200: 123 syncs per step for the 115 tensors of the 180.7 M tiny model; bench/sft_step.py). Its clip
fallback, `local_multi_tensor_scale` (:1212-1215), launches two kernels per tensor.

The replacements keep the contracts of amp_C's `multi_tensor_l2norm` (returns a 1-element float32 norm on
the grads' device, and None) and `multi_tensor_scale` (dst = src * scale), with torch's `_foreach` kernels:
a few launches for all tensors and no sync; clip_grads' own `.item()` at the end stays the step's one sync.
The per-tensor norms are fp32 as before; only the last reduction moves from the CPU to the device, so the
norm may differ in the last bit from the fallback's. Only the clip_grads module's fallbacks are swapped:
TE's or Apex's kernels, where installed, are left alone.
"""
from __future__ import annotations

import torch

from . import registry

MODULE = "megatron.core.optimizer.clip_grads"
UPSTREAM = "megatron/core/optimizer/clip_grads.py:35-43 + utils.py:1200-1215 (a .item()-like sync per tensor)"


def multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's contract: (the l2 norm of all of `tensor_lists[0]` as a [1] float32 tensor
    on their device, None). `chunk_size`, `noop_flag` and `per_tensor=False` are accepted and unused."""
    norms = torch._foreach_norm([t.float() for t in tensor_lists[0]])   # .float() of an fp32 tensor is the tensor
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale's contract: tensor_lists[1][i] = tensor_lists[0][i] * scale."""
    src, dst = tensor_lists
    torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def still_needed() -> bool:
    """True while clip_grads runs megatron's per-tensor-sync fallback (no TE, no Apex)."""
    import importlib
    module = importlib.import_module(MODULE)
    from megatron.core import utils
    original = getattr(module, "_mfsdp_kit_original_l2_norm", module.l2_norm_impl)
    return original is utils.local_multi_tensor_l2_norm and "torch.tensor(l2)" in registry.upstream_source(
        "megatron.core.utils:local_multi_tensor_l2_norm")


def enable() -> bool:
    """Swap clip_grads' fallbacks for the device-side ones; returns whether it did (False under TE/Apex)."""
    import importlib
    module = importlib.import_module(MODULE)
    from megatron.core import utils
    if module.l2_norm_impl is multi_tensor_l2_norm:
        return True
    if module.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        return False
    module._mfsdp_kit_original_l2_norm = module.l2_norm_impl
    module.l2_norm_impl = multi_tensor_l2_norm
    if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
        module.multi_tensor_scale_impl = multi_tensor_scale
    registry.record(registry.Patch(target=f"{MODULE}:l2_norm_impl", upstream=UPSTREAM, needed_if=still_needed))
    return True
