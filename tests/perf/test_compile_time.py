"""perf.compile_time: torch.compile's seconds grow when something compiles; Triton's listener counts a compile, then
a load from the disk cache for the same kernel (compiled for sm90 here, no GPU needed; skipped without Triton)."""
import importlib.util

import pytest
import torch

from mfsdp_kit.perf import compile_time


def test_torch_compile_seconds_grow_with_a_compile():
    before = compile_time.torch_compile_seconds()
    torch.compile(lambda x: x.sin() * 2)(torch.randn(8))
    assert compile_time.torch_compile_seconds() > before


def test_nothing_is_counted_before_anything_compiles():
    assert compile_time.TritonCompiles().read() == dict(seconds=0.0, kernels=0, cache_hits=0, other_seconds=0.0,
                                                       other_kernels=0, by_name={})


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (CPU-only torch)")
def test_triton_compiles_then_cache_hits(tmp_path, monkeypatch):
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def double(X, OUT, N, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(OUT + i, tl.load(X + i, mask=i < N) * 2, mask=i < N)
    if not hasattr(getattr(triton, "knobs", None), "compilation"):
        pytest.skip("this Triton has no compilation listener")
    monkeypatch.setattr(triton.knobs.compilation, "listener", None)
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))   # an empty disk cache
    counts = compile_time.TritonCompiles().listen()
    source = ASTSource(fn=double, signature={"X": "*fp32", "OUT": "*fp32", "N": "i32", "BLOCK": "constexpr"},
                       constexprs={"BLOCK": 128})
    for _ in range(2):
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    got = counts.read()   # a kernel of the tests, not the kit's: counted apart, its cache load not at all
    assert got["other_kernels"] == 1 and got["other_seconds"] > 0 and got["kernels"] == got["cache_hits"] == 0, got
    double.module = "mfsdp_kit.rl.rollout.kernels.attention"   # now as if it were one of the kit's
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "empty"))
    for _ in range(2):
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    before, got = got, counts.read()
    assert got["kernels"] == 1 and got["cache_hits"] == 1 and got["seconds"] > 0 and got["by_name"] == {"double": 1}
    assert compile_time.TritonCompiles.since(before=before, after=got) == dict(
        seconds=got["seconds"], kernels=1, cache_hits=1, other_seconds=0.0, other_kernels=0, by_name={"double": 1})
