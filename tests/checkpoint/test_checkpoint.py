"""Checkpoints on 2 gloo ranks: bitwise round trip, exact resume in a fresh process, resharding
to 1 rank and across DDP <-> FSDP, read by stock torch without the kit, a rank killed mid-save, bad metadata, trust, to_hf; components
as a dict of torch DCP Stateful objects, the user's own among them."""
import json
import os
import shutil
import stat

import pytest
import torch

from mfsdp_kit import checkpoint as ckpt
from mfsdp_kit.checkpoint import commit
from mfsdp_kit.checkpoint.manager import io_threads
from mfsdp_kit.checkpoint.restore import checked
from tests import stock_torch
from tests.dist import launch

WRAPPERS = ("fsdp", "ddp")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def saved(work):
    """Per wrapper: 10 straight steps saving at 5 (+ round trip) and 10; FSDP also an HF-sourced checkpoint.
    Both wrappers in one 2-rank job (each run inits, seeds and shuts down its own layout)."""
    calls = [["scenarios_ckpt:train_save", dict(fsdp=w == "fsdp", root=str(work / w),
                                                hf_workdir=str(work / "hf") if w == "fsdp" else None)] for w in WRAPPERS]
    return dict(zip(WRAPPERS, launch.run("sequence", nproc=2, calls=calls)))


@pytest.fixture(scope="module")
def resumed(work, saved):
    """A FRESH launch (not the one that saved), both wrappers in it: another init seed, load step 5, train steps 5..9."""
    calls = [["scenarios_ckpt:resume", dict(fsdp=w == "fsdp", root=str(work / w))] for w in WRAPPERS]
    return dict(zip(WRAPPERS, launch.run("sequence", nproc=2, calls=calls)))


@pytest.fixture(scope="module")
def more(work):
    """async_save and io_options per wrapper, then custom_stateful: one 2-rank job, a root each."""
    calls = [[f"scenarios_ckpt:{s}", dict(fsdp=w == "fsdp", root=str(work / f"{prefix}_{w}"))]
             for s, prefix in (("async_save", "async"), ("io_options", "io")) for w in WRAPPERS]
    calls.append(["scenarios_ckpt:custom_stateful", dict(root=str(work / "custom"))])
    keys = [(s, w) for s in ("async", "io") for w in WRAPPERS] + ["custom"]
    return dict(zip(keys, launch.run("sequence", nproc=2, calls=calls)))


@pytest.fixture(scope="module")
def crashed(work):
    with pytest.raises(AssertionError, match="crash_during_save failed"):
        launch.run("scenarios_ckpt:crash_during_save", nproc=2, root=str(work / "crash"))
    return work / "crash"


@pytest.fixture(scope="module")
def single(work, saved, crashed):
    return launch.run("scenarios_ckpt:single_rank_checks", nproc=1,
                      roots={w: str(work / w) for w in WRAPPERS}, crash_root=str(crashed),
                      hf_workdir=str(work / "hf"))


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_roundtrip_is_bitwise(saved, wrapper):
    r = saved[wrapper]
    print(wrapper, "save", round(r["save_s"], 3), "s, load", round(r["load_s"], 3), "s,", r["bytes"], "bytes;",
          [p["groups"] for p in r["roundtrip"]["per_rank"]])
    assert r["differs_before_load"]  # the fresh build really started elsewhere
    assert r["roundtrip"]["all_equal"], r["roundtrip"]
    for per_rank in r["roundtrip"]["per_rank"]:  # model, optimizer and RNG tensors were all compared
        assert all(n > 0 for n in per_rank["groups"].values()), per_rank
    assert r["sched_equal"] and r["rng_restored"] and r["extra"] == {"data_position": 5}
    if wrapper == "fsdp":  # one-collective shard offsets == megatron's per-tensor ones
        assert r["same_chunks"]["equal"] and r["same_chunks"]["n"] > 30 and r["same_chunks"]["nonzero_offsets"] > 0


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_resume_in_fresh_process_is_exact(saved, resumed, wrapper):
    straight, again = saved[wrapper]["losses"], resumed[wrapper]
    print(wrapper, "straight 5..9", straight[5:], "\nresumed", again["losses"])
    assert again["start"] == 5 and again["rng_restored"]
    assert again["losses"] == straight[5:]


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_keep_last_spares_loaded_and_newest(saved, wrapper):
    # keep_last=1, but step 5 was loaded through the manager before step 10 was saved.
    assert saved[wrapper]["listed"] == [5, 10] and saved[wrapper]["latest"] == 10


@pytest.mark.parametrize("case", ["fsdp->fsdp", "fsdp->ddp", "ddp->ddp", "ddp->fsdp"])
def test_reshard_two_ranks_to_one(single, case):
    assert single[case]["equal"] and single[case]["n"] == 15, single[case]


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_stock_torch_reads_the_checkpoint_without_the_kit(saved, work, tmp_path, wrapper):
    """2 ranks' checkpoint (Megatron-FSDP's uneven shards; DDP's replicated tensors) read by torch alone
    (`dcp_to_torch_save`, FileSystemReader): the weights equal those rank 0 gathered at the save, bit for bit."""
    converted, loaded = stock_torch.read(work / wrapper / "step_000005", tmp_path)
    full = torch.load(work / wrapper / "full_step5.pt", weights_only=True)
    assert len(full) > 10 and set(converted["model"]["0"]) == set(full)
    for name, want in full.items():
        assert torch.equal(converted["model"]["0"][name], want) and torch.equal(loaded[f"model.0.{name}"], want), name
    assert set(converted) >= {"model", "optimizer", "rng"}


def test_killed_save_leaves_previous_checkpoint(single, crashed):
    r = single["crash"]
    assert r["latest"] == 1 and r["listed"] == [1] and r["loaded_step"] == 1
    assert ".tmp-step_000002" in r["leftovers"] and "step_000002" not in r["leftovers"]
    assert (crashed / "latest").read_text().strip() == "step_000001"


def test_to_hf_matches_live_logits(single):
    print("to_hf logits vs live Megatron-FSDP model: max|diff|", single["to_hf_logits_maxdiff"])
    assert single["to_hf_logits_maxdiff"] < 1e-5


# ---- bad checkpoints: clear errors, before any collective --------------------------------
def _copy(saved, work, tmp_path, name="c"):
    dst = tmp_path / name
    shutil.copytree(work / "ddp" / "step_000005", dst)
    return dst


def test_missing_meta_names_directory(saved, work, tmp_path):
    d = _copy(saved, work, tmp_path)
    (d / "meta.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match=rf"{d}.* has no meta.json"):
        ckpt.read_meta(d)


def test_corrupt_meta_and_missing_file(saved, work, tmp_path):
    d = _copy(saved, work, tmp_path)
    meta = json.loads((d / "meta.json").read_text())
    (d / "__0_0.distcp").unlink()
    with pytest.raises(ckpt.CheckpointError, match=rf"{d} is missing 1 file.*__0_0.distcp"):
        ckpt.read_meta(d)
    os.chmod(d / "meta.json", 0o644)
    (d / "meta.json").write_text(json.dumps(meta)[:40])
    with pytest.raises(ckpt.CheckpointError, match="meta.json is corrupt"):
        ckpt.read_meta(d)
    del meta["step"]
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match="lacks the field 'step'"):
        ckpt.read_meta(d)


def test_missing_dcp_metadata(saved, work, tmp_path):
    d = _copy(saved, work, tmp_path)
    (d / ".metadata").unlink()
    meta = json.loads((d / "meta.json").read_text())
    meta["files"].remove(".metadata")
    meta[ckpt.integrity.DIGEST] = ckpt.integrity.seal(meta)
    os.chmod(d / "meta.json", 0o644)
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match=rf"{d} has no DCP .metadata"):
        checked(d, trust_checkpoint=False)


def test_group_writable_checkpoint_refused_unless_trusted(saved, work, tmp_path):
    d = _copy(saved, work, tmp_path)
    assert not stat.S_IMODE(os.stat(work / "ddp" / "step_000005").st_mode) & 0o022  # saved hardened
    checked(d, trust_checkpoint=False)
    os.chmod(d / "__1_0.distcp", 0o664)
    with pytest.raises(ckpt.CheckpointError, match=r"__1_0.distcp is writable by group or others.*trust_checkpoint=True"):
        checked(d, trust_checkpoint=False)
    checked(d, trust_checkpoint=True)


def test_manager_listing_and_unwritable_root(saved, work, tmp_path):
    mgr = ckpt.CheckpointManager(work / "ddp")
    assert mgr.list() == [5, 10] and mgr.latest() == 10
    assert ckpt.CheckpointManager(tmp_path / "none").latest() is None
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint under"):
        ckpt.CheckpointManager(tmp_path / "none").load([])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    verdict = commit.prepare(blocker / "sub", blocker / "sub" / ".tmp-step_000001", blocker / "sub" / "step_000001",
                             trust_checkpoint=False, allow_backwards=False)
    assert verdict and "cannot write checkpoints under" in verdict
    with pytest.raises(ValueError, match="keep_last=0"):
        ckpt.CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(ValueError, match="read_threads=0 is not allowed"):
        ckpt.CheckpointManager(tmp_path, read_threads=0)
    default = ckpt.CheckpointManager(tmp_path)   # 4 threads each without GPUs (8 where every GPU has 8+ cores)
    assert default.write_threads == default.read_threads == io_threads()
    assert torch.cuda.is_available() or io_threads() == 4


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_async_save_writes_the_staged_step(more, wrapper):
    r = more[("async", wrapper)]
    assert r["pending_after_save"] and r["changed"]  # the write overlapped training that changed every rank
    assert r["listed_after_second"] == [3] and r["listed"] == [3, 5] and r["latest"] == 5
    assert r["roundtrip"]["all_equal"], r["roundtrip"]
    assert r["resumed"] == r["straight"]


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_io_options_round_trip_bitwise(more, wrapper):
    """write_threads=3, read_threads=3 and 1, host_staging=True; a load into the optimizer that
    already has Adam state; the checksums the writer threads recorded are the files' crc32."""
    r = more[("io", wrapper)]
    print(wrapper, "save phases", {k: round(v, 4) for k, v in r["phases"].items()},
          "load phases", {k: round(v, 4) for k, v in r["load_phases"].items()})
    assert r["changed"]
    assert r["same_opt"]["all_equal"], r["same_opt"]
    assert r["one_reader"]["all_equal"], r["one_reader"]
    assert r["recorded"] == r["reread"]
    assert sum(f.startswith("__0_") for f in r["files"]) == 3  # one file per writer thread
    assert {"write", "checksum", "file_write", "fsync", "serialise", "stage", "commit"} <= set(r["phases"])
    top = {k: v for k, v in r["phases"].items() if "." not in k and k not in ("checksum", "file_write", "fsync", "serialise")}
    assert set(top) == {"state", "stage", "write", "commit"} and abs(sum(top.values()) - r["save_s"]) < 1e-3
    assert {k for k in r["load_phases"] if "." not in k} == {"find", "check", "match", "read", "restore"}
    assert {"check.checksum", "read.plan", "read.data", "read.copy", "read.wait_peers"} <= set(r["load_phases"])


# ---- components: a dict of name -> torch DCP Stateful ------------------------------------
class _Position:
    """A user's Stateful holding a tensor (-> DCP) and one holding none (-> <name>.json)."""

    def __init__(self, value, as_tensor=True):
        self.value = torch.tensor(value) if as_tensor else value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state_dict):
        if torch.is_tensor(self.value):
            self.value.copy_(state_dict["value"])
        else:
            self.value = state_dict["value"]


def test_own_stateful_components_round_trip_in_one_process(tmp_path):
    """World size 1, no process group, no model: the user's components alone save and load."""
    mgr = ckpt.CheckpointManager(tmp_path / "own")
    path = mgr.save(1, {"data": _Position([3, 1, 2]), "epoch": _Position(4, as_tensor=False)})
    meta = ckpt.read_meta(path)
    assert meta["components"] == {"data": "dcp", "epoch": "json"} and "epoch.json" in meta["files"]
    assert json.loads((path / "epoch.json").read_text()) == {"value": 4}
    data, epoch = _Position([0, 0, 0]), _Position(0, as_tensor=False)
    info = mgr.load({"data": data, "epoch": epoch})
    assert data.value.tolist() == [3, 1, 2] and epoch.value == 4 and info["restored"] == ["data", "epoch"]
    with pytest.raises(ckpt.CheckpointError, match=r"holds no component 'other' \(it holds data, epoch\)"):
        mgr.load({"data": data, "other": _Position(0)})


def test_components_are_checked_before_anything_is_written(tmp_path):
    mgr = ckpt.CheckpointManager(tmp_path / "bad")
    with pytest.raises(ckpt.CheckpointError, match=r"component name 'my.data' is not allowed"):
        mgr.save(1, {"my.data": _Position(1)})
    with pytest.raises(ckpt.CheckpointError, match=r"component name 'meta' is not allowed"):
        mgr.save(1, {"meta": _Position(1)})
    with pytest.raises(ckpt.CheckpointError, match=r"component 'data' \(int\) is not a torch.distributed.checkpoint Stateful"):
        mgr.save(1, {"data": 3})
    with pytest.raises(ckpt.CheckpointError, match=r"component 'epoch' holds no tensor, so it goes to epoch.json"):
        mgr.save(1, {"epoch": _Position(object(), as_tensor=False)})
    with pytest.raises(TypeError, match="inside the components dict"):
        mgr.save(1, {"data": _Position(1)}, object())
    assert mgr.list() == [] and not [p for p in (tmp_path / "bad").iterdir() if p.name.startswith(".")]


def test_call_form_with_chunks_is_the_standard_dict():
    parts = ckpt.as_components([], optimizer=object(), scheduler="sched")
    assert list(parts) == ["model", "optimizer", "rng", "scheduler"] and parts["scheduler"] == "sched"
    assert isinstance(parts["model"], ckpt.ModelState) and isinstance(parts["optimizer"], ckpt.OptimizerState)
    assert list(ckpt.as_components([], rng=False)) == ["model"]


@pytest.fixture(scope="module")
def custom(more):
    return more["custom"]


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_own_stateful_round_trips_with_the_model(wrapper, custom):
    """2 ranks: a data loader (tensors) and a counter (JSON) next to model, optimizer, RNG, scheduler."""
    r = custom[wrapper]
    print(wrapper, "straight", r["straight"], "\nresumed ", r["resumed"])
    assert r["differs_before_load"] and r["resumed"] == r["straight"]
    assert r["loaded"] == dict(position=3, counter=r["saved_counter"], order_equal=True) and r["saved_counter"] > 0
    assert r["restored"] == ["model", "optimizer", "rng", "scheduler", "data", "counter"] and r["rng_restored"]
    assert r["components"] == dict(model="dcp", optimizer="dcp", rng="dcp", scheduler="json", data="dcp", counter="json")
    assert r["data_keys"] == ["data.order", "data.position"] and {"counter.json", "scheduler.json"} <= set(r["files"])
    assert r["legacy"] == ["model", "rng"]
    assert "holds no component 'other'" in r["missing"]
