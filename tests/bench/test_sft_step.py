"""bench/sft_step.py end to end on 2 gloo ranks (the notebooks' CPU model, xs in fp32): the wrapper and the
attention backend change how the step runs, not what it computes."""
from tests.bench.cli import run


def test_sft_step_bench(tmp_path):
    res = run("sft_step.py", "--variants", "ddp-local,fsdp-sdpa", "--steps", "2", "--warmup", "1",
              "--profile-steps", "1", out=tmp_path / "s.json")
    assert res["world"] == 2 and list(res["results"]) == ["ddp-local", "fsdp-sdpa"]
    ddp, fsdp = res["results"]["ddp-local"]["losses"], res["results"]["fsdp-sdpa"]["losses"]
    assert len(ddp) == len(fsdp) == 4                        # warm-up + timed + profiled
    assert max(abs(a - b) for a, b in zip(ddp, fsdp)) < 1e-4 * ddp[0]
    for r in res["results"].values():
        assert r["step_ms"] > 0 and r["copies_per_step"] == r["kernels_per_step"] == 0
