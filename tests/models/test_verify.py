"""models.verify: load(verify=True) reports the logit difference to transformers; a changed model is caught."""
import pytest

from tests.dist import launch


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """DDP then FSDP in one 2-rank job, each from a folder of its own."""
    work = tmp_path_factory.mktemp("verify")
    for fsdp in (False, True):
        (work / str(fsdp)).mkdir()
    calls = [["scenarios_arch:verify_detects", dict(workdir=str(work / str(fsdp)), fsdp=fsdp)] for fsdp in (False, True)]
    return dict(zip((False, True), launch.run("sequence", calls=calls)))


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_verify_passes_a_faithful_model_and_catches_a_changed_one(runs, fsdp):
    r = runs[fsdp]
    print(r["good"], r["bad_str"], f"load(verify=True) {r['load_verify_s']:.2f}s")
    assert r["good"]["ok"] and r["good"]["relative"] < 1e-5 and r["good"]["tokens_shape"] == [2, 16]
    assert not r["bad"]["ok"] and r["bad"]["relative"] > 1e-3
    assert "MISMATCH" in r["bad_str"]
    assert r["raised"] and "The Megatron model is not the HF model" in r["raised"]
