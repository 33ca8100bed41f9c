"""Megatron-Core 0.16.1's gradient norm without TE or Apex waits on the GPU once per parameter.

Without TE/Apex, optimizer/clip_grads.py:35-43 falls back to `megatron.core.utils.local_multi_tensor_l2_norm`
(utils.py:1200-1208), which builds `torch.tensor(l2)` from a list of per-parameter 0-dim norms on the GPU:
one device-to-host copy, and so one `cudaStreamSynchronize`, per gradient tensor, every step (counted by
bench/sft_step.py: docs/benchmarks.md, notebooks, "Cutting the host work"). Its clip fallback,
`local_multi_tensor_scale` (:1212-1215), launches two kernels per tensor.

The replacements keep the contracts of amp_C's `multi_tensor_l2norm` (returns a 1-element float32 norm on
the grads' device, and None) and `multi_tensor_scale` (dst = src * scale), with torch's `_foreach` kernels:
a few launches for all tensors and no sync; clip_grads' own `.item()` at the end stays the step's one sync.
The per-tensor norms are fp32 as before; only the last reduction moves from the CPU to the device, so the
norm may differ in the last bit from the fallback's. Only the clip_grads module's fallbacks are swapped:
TE's or Apex's kernels, where installed, are left alone.

That `.item()` (clip_grads.py:133, `get_grad_norm_fp32`) and the host test of the clip factor
(clip_grads.py:173, `if clip_coeff < 1.0`) are the optimizer step's last host syncs: after them the GPU
drains and waits while the host issues the rest of the step and the next step's first forward. So the
optimizer module's two names are bound to `grad_norm_fp32` and `clip_by_total_norm`: the L2 norm stays a
0-dim float64 tensor on the device, computed as megatron computes it (fp32 squares all-reduced, then
the square root in double, as `.item() ** 0.5` takes it), and the grads are always scaled by
`where(coeff < 1, coeff, 1)`: the same bits (x * 1.0 == x; a NaN norm leaves them as megatron does).
Only the optimizer module's copies are rebound, so compat.patches.cpu's rewrite of clip_grads' own function
stays what the fallback (a norm that is not a tensor, or not L2) calls.
"""
from __future__ import annotations

import torch

from .. import registry

MODULE = "megatron.core.optimizer.clip_grads"
UPSTREAM = "megatron/core/optimizer/clip_grads.py:35-43 + utils.py:1200-1215 (a .item()-like sync per tensor)"
# A param with this attribute gets its fp32 grad inside the optimizer step (mfsdp_kit.distributed.grad_upcast): the clip
# stores its factor here (a 0-dim fp32 tensor) and the step multiplies that grad by it once it exists.
LATER_SCALE = "_mfsdp_grad_scale"


def multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's contract: (the l2 norm of all of `tensor_lists[0]` as a [1] float32 tensor
    on their device, None). `chunk_size`, `noop_flag` and `per_tensor=False` are accepted and unused."""
    # fp32 accumulation without fp32 copies: a bf16 grad shard's norm has the bits of its fp32 copy's
    norms = torch._foreach_norm(tensor_lists[0], 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale's contract: tensor_lists[1][i] = tensor_lists[0][i] * scale."""
    src, dst = tensor_lists
    torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
    """clip_grads.get_grad_norm_fp32 for the L2 norm, returned as a 0-dim float64 tensor on the grads' device
    instead of a Python float (no host sync); any other norm type goes to megatron's."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor
    if float(norm_type) != 2.0:
        return clip_grads.get_grad_norm_fp32(grads_for_norm, norm_type, grad_stats_parallel_group)
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    dp_group = None
    for grad in grads_for_norm:
        dp_group = get_data_parallel_group_if_dtensor(grad, dp_group)
    grads = [to_local_if_dtensor(grad) for grad in grads_for_norm]
    device = grads[0].device if grads else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if grads:
        overflow = torch.zeros(1, dtype=torch.int, device=device)
        norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, overflow, [grads], False)
    else:
        norm = torch.zeros(1, dtype=torch.float, device=device)
    total = norm ** 2.0
    if dp_group:
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=dp_group)
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=grad_stats_parallel_group)
    return total[0].double() ** 0.5


def clip_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad: bool = False) -> None:
    """clip_grads.clip_grad_by_total_norm_fp32 with the clip factor kept on the device: every fp32 grad
    times where(max_norm / (norm + 1e-6) < 1, that, 1). A param carrying `LATER_SCALE` has no fp32 grad yet
    (`grad_upcast` makes it in the step): the factor is stored there, to be applied to that grad in fp32.
    A norm that is not a tensor goes to megatron's for the other params."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import to_local_if_dtensor
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    later = [p for p in parameters if hasattr(p, LATER_SCALE)]
    if later:
        norm = torch.as_tensor(total_norm, dtype=torch.float64, device=later[0].device)
        factor = clip_factor(max_norm, norm).to(torch.float32)
        for p in later:
            setattr(p, LATER_SCALE, factor)
        parameters = [p for p in parameters if not hasattr(p, LATER_SCALE)]
    if not torch.is_tensor(total_norm):
        return clip_grads.clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad)
    name = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [to_local_if_dtensor(getattr(p, name)).detach() for p in parameters if getattr(p, name, None) is not None]
    if not grads:
        return
    if any(g.dtype != torch.float32 for g in grads) and not use_decoupled_grad:   # megatron asserts fp32 grads
        raise AssertionError("clip_by_total_norm: megatron clips fp32 main grads only")
    torch._foreach_mul_(grads, clip_factor(max_norm, total_norm).to(grads[0].dtype))


def clip_factor(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """megatron's clip factor on the device: max_norm / (norm + 1e-6) where that is < 1, else 1 (NaN -> 1)."""
    coeff = max_norm / (total_norm + 1.0e-6)
    return torch.where(coeff < 1.0, coeff, torch.ones_like(coeff))


def still_needed() -> bool:
    """True while clip_grads runs megatron's per-tensor-sync fallback (no TE, no Apex)."""
    import importlib
    module = importlib.import_module(MODULE)
    from megatron.core import utils
    original = getattr(module, "_mfsdp_kit_original_l2_norm", module.l2_norm_impl)
    return original is utils.local_multi_tensor_l2_norm and "torch.tensor(l2)" in registry.upstream_source(
        "megatron.core.utils:local_multi_tensor_l2_norm")


def _enable() -> bool:
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


OPTIMIZER = "megatron.core.optimizer.optimizer"


def _enable_on_device() -> None:
    """Bind the optimizer module's grad norm and clip to `grad_norm_fp32` / `clip_by_total_norm` (idempotent)."""
    import importlib
    module = importlib.import_module(OPTIMIZER)
    module.get_grad_norm_fp32, module.clip_grad_by_total_norm_fp32 = grad_norm_fp32, clip_by_total_norm
    registry.record(registry.Patch(target=f"{MODULE}:get_grad_norm_fp32", needed_if="total_norm.item()",
                                   upstream="megatron/core/optimizer/clip_grads.py:133 (.item() of the norm)"))
    registry.record(registry.Patch(target=f"{MODULE}:clip_grad_by_total_norm_fp32", needed_if="if clip_coeff < 1.0",
                                   upstream="megatron/core/optimizer/clip_grads.py:173 (clip factor tested on the host)"))
