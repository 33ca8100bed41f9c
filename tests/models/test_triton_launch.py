"""models.triton_launch: inside `ahead()` a kit kernel's launch is recorded, not run; `compile_all` then compiles
it, so its real launch compiles and loads nothing (a GPU); one compile per specialisation. The recording runs on CPU
in Triton's interpreter (TRITON_INTERPRET=1; tests/rl/test_attention.py says how), the compile on a GPU."""
import pytest
import torch

from mfsdp_kit.models import fusions, triton_launch
from mfsdp_kit.perf.compile_time import TritonCompiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels_run = pytest.mark.skipif(not fusions.triton_runs(on_gpu=DEVICE == "cuda"),
                                 reason="the kernels run on a GPU (Triton), or on CPU in its interpreter")
on_gpu = pytest.mark.skipif(DEVICE != "cuda" or not fusions.triton_runs(on_gpu=True), reason="compiles for a GPU")


def _add_rms_inputs(hidden: int, dtype=torch.float32):
    """x, delta [3, hidden] and the norm's weight [hidden] on DEVICE."""
    g = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(3, hidden, generator=g).to(DEVICE, dtype) for _ in range(2))
    return x, delta, torch.rand(hidden, generator=g).to(DEVICE, dtype)


@kernels_run
def test_ahead_records_launches_and_runs_none():
    """The cache write of `rope_store` (the one kernel that writes a tensor the caller owns): recorded inside
    `ahead()`, the cache stays zero; outside, it is written."""
    from mfsdp_kit.rl.rollout import elementwise
    b, kv_heads, dim, slots = 2, 2, 16, 4
    q, k, v = (torch.randn(b, h, dim, device=DEVICE) for h in (4, kv_heads, kv_heads))
    cos, sin = torch.ones(b, 1, dim, device=DEVICE), torch.zeros(b, 1, dim, device=DEVICE)
    where = torch.arange(b * kv_heads, device=DEVICE) * slots
    kc, vc = (torch.zeros(b * kv_heads * slots, dim, device=DEVICE) for _ in range(2))
    with triton_launch.ahead() as launches:
        elementwise.rope_store(q, k, v, cos, sin, kc, vc, where)
        elementwise.gated(torch.randn(b, 2 * dim, device=DEVICE))
    assert [kernel for kernel, *_ in launches] == [elementwise._rope_store, elementwise._gated]
    assert not kc.any() and not vc.any()
    elementwise.rope_store(q, k, v, cos, sin, kc, vc, where)   # outside: runs (cos 1, sin 0: k as it is)
    torch.testing.assert_close(kc[where], k.reshape(-1, dim))
    torch.testing.assert_close(vc[where], v.reshape(-1, dim))
    assert len(launches) == 2


def test_specialisation_merges_what_triton_does_not_look_at():
    a, b = torch.zeros(32), torch.zeros(48)
    key = triton_launch.specialisation
    assert key((a, 32, 0.5), dict(BLOCK=64)) == key((b, 64, 0.25), dict(BLOCK=64))   # dtype, aligned, %16, float
    assert key((a, 32), {}) != key((a, 33), {})   # divisible by 16 or not
    assert key((a, 1), {}) != key((a, 17), {})    # 1 is a constant
    assert key((a, 2 ** 40), {}) != key((a, 2 ** 4), {})   # 64-bit
    assert key((a, 32), dict(BLOCK=64)) != key((a, 32), dict(BLOCK=128))
    assert key((a,), {}) != key((a.double(),), {})
    assert key((a,), {}) != key((a[1:],), {})   # misaligned by 4 bytes


@kernels_run
def test_compile_all_in_the_interpreter_compiles_nothing():
    from mfsdp_kit.rl.rollout import elementwise
    with triton_launch.ahead() as launches:
        elementwise.add_rms(*_add_rms_inputs(64), 1e-6)
    if DEVICE == "cpu":
        assert triton_launch.compile_all(launches, device=torch.device("cpu")) == 0.0


@on_gpu
def test_compile_all_leaves_the_real_launch_nothing_to_compile():
    """A fresh JITFunction of the kit's add-RMSNorm kernel (its own in-process cache, empty): three specialisations
    recorded, compiled on threads; the launches after compile and load nothing, and compute the sum."""
    import triton
    from mfsdp_kit.rl.rollout import elementwise
    fresh = triton.jit(elementwise._add_rms.fn)
    counts = TritonCompiles().listen()
    inputs = [_add_rms_inputs(hidden, dtype) for hidden, dtype in ((64, torch.float32), (96, torch.bfloat16),
                                                                   (64, torch.bfloat16))]

    def call(x, delta, w):
        total, normed = torch.empty_like(x), torch.empty_like(x)
        triton_launch.launch(fresh, (x.shape[0],), x, delta, w, total, normed, x.stride(0), delta.stride(0), 1e-6,
                             HIDDEN=x.shape[1], BLOCK=triton.next_power_of_2(x.shape[1]))
        return total
    with triton_launch.ahead() as launches:
        for args in inputs + inputs:   # recorded twice: compiled once
            call(*args)
    assert len(launches) == 6
    seconds = triton_launch.compile_all(launches, device=torch.device("cuda"))
    before = counts.read()
    assert seconds > 0 and before["kernels"] + before["cache_hits"] == 3
    for x, delta, w in inputs:
        torch.testing.assert_close(call(x, delta, w), (x.float() + delta.float()).to(x.dtype))
    after = counts.read()
    assert (after["kernels"], after["cache_hits"]) == (before["kernels"], before["cache_hits"])
