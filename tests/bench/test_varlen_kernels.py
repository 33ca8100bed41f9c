"""bench/varlen_kernels.py on CPU: the padded dense kernel agrees with the per-sequence fp32 reference on the
row's real tokens, the row fills its budget, and a kernel CPU torch lacks is recorded as an error."""
import pytest

from tests.bench.cli import run


def test_varlen_kernels_bench(tmp_path):
    res = run("varlen_kernels.py", "--heads", "2", "--head-dim", "16", "--budget", "1200", "--dtype", "fp32",
              "--repeats", "1", "--kernels", "per-sequence,dense,flash", out=tmp_path / "vk.json", nproc=1)
    lens, r = res["lengths"], res["results"]
    assert len(lens) >= 2 and sum(lens) == res["tokens"] <= 1200
    assert res["useful_fwd_flops"] == pytest.approx(2 * sum(n * n for n in lens) * 2 * 16)
    assert max(r["per-sequence"]["max_diff"].values()) == 0.0   # the reference's own code path, same inputs
    assert max(r["dense"]["max_diff"].values()) < 1e-5          # padded to the longest: same numbers, fp32 roundoff
    assert r["dense"]["fwd_ms"] > 0 and r["dense"]["fwd_bwd_ms"] > 0
    assert "NotImplementedError" in r["flash"]["error"]         # no FA2 kernel on CPU: recorded, the rest ran
