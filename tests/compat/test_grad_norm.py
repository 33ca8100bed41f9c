"""compat.grad_norm: the device-side grad norm and clip scale keep the contracts of megatron's fallbacks."""
import torch

from mfsdp_kit.compat import cpu, grad_norm, registry


def _grads():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g) * s for n, s in ((1000, 1e-3), (7, 10.0), (4096, 1.0), (1, 0.0))]


def test_l2_norm_matches_megatrons_fallback():
    from megatron.core.utils import local_multi_tensor_l2_norm
    cpu.enable()   # the fallback puts its result on device="cuda"
    grads = _grads()
    ours, none = grad_norm.multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    theirs, _ = local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    assert none is None and ours.shape == (1,) and ours.dtype == torch.float32
    assert torch.allclose(ours, theirs.cpu(), rtol=1e-6, atol=0)
    # bf16 grads: norms taken in fp32, as the fallback's torch.norm of an fp32 main grad
    bf16 = [t.bfloat16() for t in grads]
    ours16, _ = grad_norm.multi_tensor_l2_norm(0, None, [bf16], False)
    assert ours16.dtype == torch.float32
    assert torch.allclose(ours16, torch.linalg.vector_norm(torch.cat([t.float() for t in bf16])), rtol=1e-6)


def test_scale_is_bitwise_megatrons_fallback():
    from megatron.core.utils import local_multi_tensor_scale
    src = _grads()
    ours, theirs = [torch.empty_like(t) for t in src], [torch.empty_like(t) for t in src]
    grad_norm.multi_tensor_scale(0, None, [src, ours], 0.37)
    local_multi_tensor_scale(0, None, [src, theirs], 0.37)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    in_place = [t.clone() for t in src]
    grad_norm.multi_tensor_scale(0, None, [in_place, in_place], 0.37)   # clip_grads scales grads in place
    assert all(torch.equal(a, b) for a, b in zip(in_place, theirs))


def test_enable_swaps_clip_grads_fallbacks_and_is_still_needed():
    import megatron.core.optimizer.clip_grads as clip_grads
    assert grad_norm.enable() and grad_norm.enable()   # idempotent
    assert clip_grads.l2_norm_impl is grad_norm.multi_tensor_l2_norm
    assert clip_grads.multi_tensor_scale_impl is grad_norm.multi_tensor_scale
    patch = next(p for p in registry.ACTIVE if p.target == f"{grad_norm.MODULE}:l2_norm_impl")
    assert patch.still_needed()
