"""bench/throughput.py end to end on 2 gloo ranks (spec tiny, fp32): ddp, fsdp and fsdp2 train the
same model on the same batches, and --profile writes and reads back a trace per mode.
The arithmetic it reports is tested in tests/perf."""
import pytest

from mfsdp_kit.models.gpt import SPECS
from mfsdp_kit.perf.flops import flops_per_token
from tests.bench.cli import run


@pytest.mark.parity
def test_throughput_bench(tmp_path):
    res = run("throughput.py", "--spec", "tiny", "--steps", "2", "--warmup", "1", "--profile",
              "--modes", "ddp,fsdp,fsdp2,fsdp-recompute", "--profile-modes", "fsdp", out=tmp_path / "t.json")
    results = res["results"]
    assert list(results) == ["ddp", "fsdp", "fsdp2", "fsdp-recompute"]
    assert not [m for m, r in results.items() if "error" in r], results
    assert res["flops_per_token"] == flops_per_token(SPECS["tiny"]) and res["world"] == 2
    ddp = results["ddp"]["losses"]
    print({m: max(abs(a - b) for a, b in zip(r["losses"], ddp)) for m, r in results.items()}, "(max |loss - DDP's|)")
    for r in results.values():  # same seed, init and batches, 3 steps: the modes differ only by rounding
        assert len(r["losses"]) == 3 and max(abs(a - b) for a, b in zip(r["losses"], ddp)) < 1e-4
        assert r["tokens_per_s_per_gpu"] > 0 and r["memory"]["model_state_bytes"] > 0
    assert results["fsdp-recompute"]["variant"]["config"]["recompute"] == "full"
    profile = results["fsdp"]["profile"]
    assert profile["steps"] == 2 and profile["num_activities"] == 0 and profile["trace"].endswith(".fsdp.trace.json.gz")
    assert "profile" not in results["ddp"]
