"""A load refused for damaged bytes leaves the live job as it was (issue 69 item 6), on 2 gloo ranks."""
import pytest

from tests.dist import launch


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp", "ddp"])
def test_refused_load_leaves_every_tensor_as_it_was(tmp_path, fsdp):
    """256 flipped bytes in a shard of the newest step, loaded into the job that trained one step past it: a
    CheckpointCorruptError naming the file and its crc32 on every rank, and every model parameter, optimizer state
    and RNG tensor bitwise (and the scheduler) what it was before the call; `fallback=True` then loads the step
    before, bit for bit. Before the fix the read had already copied part of the checkpoint into the model."""
    r = launch.run("scenarios_ckpt_refused:refused_load", nproc=2, root=str(tmp_path / "ckpt"), fsdp=fsdp)
    refused = r["refused"]
    print(refused["message"], "\nrefused in", [round(p["seconds"], 3) for p in refused["per_rank"]], "s")
    assert refused["same"] and refused["type"] == "CheckpointCorruptError", refused
    assert f"{r['shard']} has crc32" in refused["message"] and "was saved" in refused["message"], refused
    assert r["moved"], r   # the live job had left step 2: any tensor read from it would show
    assert r["untouched"]["all_equal"] and r["sched_untouched"], r
    for per_rank in r["untouched"]["per_rank"]:   # model, optimizer and RNG tensors were all compared
        assert all(n > 0 for n in per_rank["groups"].values()), per_rank
    assert r["step"] == 1 and [s["step"] for s in r["fallback_from"]] == [2], r
    assert r["fell_back"]["all_equal"] and r["sched_fell_back"], r["fell_back"]   # the scheduler at step 1 too
