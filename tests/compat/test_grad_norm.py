"""compat.patches.grad_norm: the device-side grad norm and clip scale keep the contracts of megatron's fallbacks."""
import pytest
import torch

from mfsdp_kit import compat
from mfsdp_kit.distributed import runtime
from mfsdp_kit.compat.patches import grad_norm
from mfsdp_kit.compat import registry
from mfsdp_kit.config import EngineConfig
from tests.dist.hostreads import no_host_reads


@pytest.fixture
def world():
    from tests.dist.launch import free_port
    runtime.init(EngineConfig(), rank=0, world_size=1, master_port=free_port())   # the norm is all-reduced
    yield
    runtime.shutdown()


def _grads():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g) * s for n, s in ((1000, 1e-3), (7, 10.0), (4096, 1.0), (1, 0.0))]


def test_l2_norm_matches_megatrons_fallback():
    from megatron.core.utils import local_multi_tensor_l2_norm
    compat.apply("cpu")   # the fallback puts its result on device="cuda"
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
    assert compat.apply("grad_norm") and compat.apply("grad_norm")   # idempotent
    assert clip_grads.l2_norm_impl is grad_norm.multi_tensor_l2_norm
    assert clip_grads.multi_tensor_scale_impl is grad_norm.multi_tensor_scale
    patch = next(p for p in registry.ACTIVE if p.target == f"{grad_norm.MODULE}:l2_norm_impl")
    assert patch.still_needed()


@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clips", "does-not-clip"])
def test_norm_and_clip_on_the_device_equal_megatrons(world, max_norm):
    """grad_norm_fp32 / clip_by_total_norm give megatron's norm (as a device tensor) and the same clipped grads,
    bit for bit, whether the grads are clipped or not; neither reads a tensor on the host."""
    import megatron.core.optimizer.clip_grads as clip_grads
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=g) for n in (7, 33, 128)]
    params = [torch.nn.Parameter(torch.zeros_like(x)) for x in grads]
    theirs_norm = clip_grads.get_grad_norm_fp32([x.clone() for x in grads])
    for p, x in zip(params, grads):
        p.grad = x.clone()
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm, theirs_norm)
    theirs = [p.grad.clone() for p in params]
    for p, x in zip(params, grads):
        p.grad = x.clone()
    with no_host_reads():
        ours_norm = grad_norm.grad_norm_fp32([x.clone() for x in grads])
        grad_norm.clip_by_total_norm(params, max_norm, ours_norm)
    assert torch.is_tensor(ours_norm) and ours_norm.dim() == 0 and float(ours_norm) == theirs_norm
    assert all(torch.equal(p.grad, t) for p, t in zip(params, theirs))
    assert (max_norm < theirs_norm) == (not torch.equal(params[0].grad, grads[0]))


def test_bf16_norm_has_the_bits_of_its_fp32_copys():
    """grad_upcast hands the norm bf16 grad shards instead of their fp32 copies: the same bits."""
    bf16 = [t.bfloat16() for t in _grads()]
    ours, _ = grad_norm.multi_tensor_l2_norm(0, None, [bf16], False)
    copies, _ = grad_norm.multi_tensor_l2_norm(0, None, [[t.float() for t in bf16]], False)
    assert torch.equal(ours, copies)


@pytest.mark.parametrize("max_norm", [0.5, 1e6], ids=["clips", "does-not-clip"])
def test_clip_keeps_the_factor_for_grads_made_later(world, max_norm):
    """A param carrying LATER_SCALE (its fp32 grad made later, in the step) gets the clip factor stored: the
    factor that multiplies the other grads, as a 0-dim fp32 tensor; its own grad (none yet) is not touched."""
    g = torch.Generator().manual_seed(4)
    now = [torch.nn.Parameter(torch.zeros(9)) for _ in range(2)]
    later = torch.nn.Parameter(torch.zeros(5))
    for p in now:
        p.grad = torch.randn(9, generator=g)
    setattr(later, grad_norm.LATER_SCALE, None)
    before = [p.grad.clone() for p in now]
    norm = torch.tensor(3.0, dtype=torch.float64)
    grad_norm.clip_by_total_norm([*now, later], max_norm, norm)
    factor = getattr(later, grad_norm.LATER_SCALE)
    assert later.grad is None and factor.dim() == 0 and factor.dtype == torch.float32
    assert factor == torch.tensor(min(max_norm / (3.0 + 1e-6), 1.0), dtype=torch.float32)
    assert all(torch.equal(p.grad, b * factor) for p, b in zip(now, before))


def test_enable_on_device_binds_the_optimizer_module_and_is_still_needed():
    import megatron.core.optimizer.optimizer as optimizer
    compat.apply("grad_norm_on_device")
    compat.apply("grad_norm_on_device")
    assert optimizer.get_grad_norm_fp32 is grad_norm.grad_norm_fp32
    assert optimizer.clip_grad_by_total_norm_fp32 is grad_norm.clip_by_total_norm
    for name in ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32"):
        assert next(p for p in registry.ACTIVE if p.target == f"{grad_norm.MODULE}:{name}").still_needed()
