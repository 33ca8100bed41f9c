"""bench/fusions.py at toy shapes on one gloo rank: every op's implementations run forward and backward, and
each stays within bf16 rounding of megatron's function in fp32 (the table's accuracy columns are real)."""
from tests.bench.cli import run


def test_fusions_bench(tmp_path):
    res = run("fusions.py", "--spec", "tiny", "--iters", "2", "--warmup", "1", out=tmp_path / "f.json", nproc=1)
    assert set(res["results"]) == {"rope", "swiglu", "cross_entropy", "rms_norm"}
    # the Triton rows come where Triton runs (a GPU, or its interpreter), for RoPE and SwiGLU together
    triton = set(res["results"]["swiglu"]) - {"megatron eager", "megatron fused (compiled)"}
    assert triton <= {"kit, Triton"} and ("kit, Triton" in res["results"]["rope"]) == bool(triton)
    assert len(res["results"]["cross_entropy"]) == 3 and len(res["results"]["rope"]) == 3 + len(triton)
    for op, impls in res["results"].items():
        for name, r in impls.items():
            assert r["ms"] > 0 and r["first_s"] > 0 and r["calls_per_step"] > 0, (op, name, r)
            assert r["out_max_diff"] < 0.05 and r["grad_max_diff"] < 0.05, (op, name, r)   # bf16 rounding, not a bug
    # the kit's cross-entropy loss is megatron's to fp32 rounding (the loss is fp32 in both)
    assert res["results"]["cross_entropy"]["kit (cross_entropy)"]["out_max_diff"] < 1e-4
