"""models.triton_launch: inside `ahead()` a kit kernel's launch is recorded, not run; `compile_all` then compiles
it, so its real launch compiles and loads nothing (a GPU); one compile per specialisation; `compile_soon` compiles
once in the background. The recording runs on CPU in Triton's interpreter (TRITON_INTERPRET=1;
tests/rl/rollout/kernels/test_attention.py says how), the compile on a GPU."""
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
    """The cache write of `rope_store` (a kernel that writes a tensor the caller owns, as the fused attention does):
    recorded inside `ahead()`, the cache stays zero; outside, it is written."""
    from mfsdp_kit.rl.rollout.kernels import elementwise
    b, kv_heads, dim, slots = 2, 2, 16, 4
    q, k, v = (torch.randn(b, h, dim, device=DEVICE) for h in (4, kv_heads, kv_heads))
    cos, sin = torch.ones(b, 1, dim, device=DEVICE), torch.zeros(b, 1, dim, device=DEVICE)
    where = torch.arange(b * kv_heads, device=DEVICE) * slots
    kc, vc = (torch.zeros(b * kv_heads * slots, dim, device=DEVICE) for _ in range(2))
    with triton_launch.ahead() as launches:
        elementwise.rope_store(q, k, v, cos, sin, kc, vc, where)
        elementwise.gated(torch.randn(b, 2 * dim, device=DEVICE))
    assert [kernel.fn.__name__ for kernel, *_ in launches] == ["_rope_store", "_gated"]
    recorded = launches[0][2]   # stand-ins of the tensors (16 elements, same dtype and alignment), not the tensors
    assert [t.numel() for t in recorded[:8]] == [16] * 8 and recorded[5].dtype == kc.dtype
    assert triton_launch.specialisation(args=recorded, kwargs={}) == triton_launch.specialisation(
        args=(q, k, v, cos, sin, kc, vc, where) + recorded[8:], kwargs={})
    assert not kc.any() and not vc.any()
    elementwise.rope_store(q, k, v, cos, sin, kc, vc, where)   # outside: runs (cos 1, sin 0: k as it is)
    torch.testing.assert_close(kc[where], k.reshape(-1, dim))
    torch.testing.assert_close(vc[where], v.reshape(-1, dim))
    assert len(launches) == 2


def test_specialisation_merges_what_triton_does_not_look_at():
    a, b = torch.zeros(32), torch.zeros(48)
    def key(args, kwargs):
        return triton_launch.specialisation(args=args, kwargs=kwargs)
    assert key((a, 32, 0.5), dict(BLOCK=64)) == key((b, 64, 0.25), dict(BLOCK=64))   # dtype, aligned, %16, float
    assert key((a, 32), {}) != key((a, 33), {})   # divisible by 16 or not
    assert key((a, 1), {}) != key((a, 17), {})    # 1 is a constant
    assert key((a, 2 ** 40), {}) != key((a, 2 ** 4), {})   # 64-bit
    assert key((a, 32), dict(BLOCK=64)) != key((a, 32), dict(BLOCK=128))
    assert key((a,), {}) != key((a.double(),), {})
    assert key((a,), {}) != key((a[1:],), {})   # misaligned by 4 bytes


@kernels_run
def test_compile_all_in_the_interpreter_compiles_nothing():
    from mfsdp_kit.rl.rollout.kernels import elementwise
    with triton_launch.ahead() as launches:
        elementwise.add_rms(*_add_rms_inputs(64), 1e-6)
    if DEVICE == "cpu":
        assert triton_launch.compile_all(launches, device=torch.device("cpu")) == 0.0


if fusions.triton_runs(on_gpu=DEVICE == "cuda"):   # a kernel of the tests (the interpreter's on CPU)
    import triton
    import triton.language as tl

    @triton.jit
    def _double(X, OUT, N, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(OUT + i, tl.load(X + i, mask=i < N) * 2, mask=i < N)


@on_gpu
def test_compile_all_leaves_the_real_launch_nothing_to_compile(tmp_path, monkeypatch):
    """A kernel of this test on an empty disk cache: three specialisations recorded twice, compiled once each on the
    compile threads; the launches after compile nothing (the listener counts a test's kernel as `other`) and compute
    the doubles."""
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    monkeypatch.setattr(triton.knobs.compilation, "listener", None)
    counts = TritonCompiles().listen()
    inputs = [torch.randn(n, device=DEVICE, dtype=dtype) for n, dtype in ((64, torch.float32), (100, torch.float32),
                                                                          (64, torch.bfloat16))]

    def call(x):
        out = torch.empty_like(x)
        triton_launch.launch(_double, (1,), x, out, x.numel(), BLOCK=128)
        return out
    with triton_launch.ahead() as launches:
        for x in inputs + inputs:
            call(x)
    assert len(launches) == 6
    seconds = triton_launch.compile_all(launches, device=torch.device("cuda"))
    assert seconds > 0 and counts.read()["other_kernels"] == 3
    for x in inputs:
        torch.testing.assert_close(call(x), x * 2)
    assert counts.read()["other_kernels"] == 3


@kernels_run
def test_compile_soon_compiles_nothing_in_the_interpreter():
    if DEVICE == "cpu":
        assert triton_launch.compile_soon(_double, (1,), torch.zeros(4), torch.zeros(4), 4, BLOCK=128) is None


@on_gpu
def test_compile_soon_compiles_once_in_the_background(tmp_path, monkeypatch):
    """Asked twice for one specialisation: one background compile (one future); the launch after it compiles
    nothing."""
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    monkeypatch.setattr(triton.knobs.compilation, "listener", None)
    counts = TritonCompiles().listen()
    x = torch.randn(48, device=DEVICE)
    out = torch.empty_like(x)
    futures = [triton_launch.compile_soon(_double, (1,), x, out, x.numel(), BLOCK=64) for _ in range(2)]
    assert futures[0] is futures[1]
    futures[0].result()
    assert counts.read()["other_kernels"] == 1
    triton_launch.launch(_double, (1,), x, out, x.numel(), BLOCK=64)
    torch.testing.assert_close(out, x * 2)
    assert counts.read()["other_kernels"] == 1
