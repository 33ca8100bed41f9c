"""meta.json is covered by the checks (issue 51): its digest is verified before any field is used, its step is
the folder's, its layout fields hold what a save writes; a checkpoint without a digest loads only when trusted."""
from __future__ import annotations

import json

import pytest
import torch

from mfsdp_kit import checkpoint as ckpt
from mfsdp_kit.checkpoint import integrity
from tests.small_state import Small


@pytest.fixture
def step3(tmp_path):
    mgr = ckpt.CheckpointManager(tmp_path)
    return mgr, mgr.save(3, {"s": Small(3.0)})


def _edit(step, fields: dict, *, reseal: bool) -> None:
    meta = json.loads((step / "meta.json").read_text())
    meta.update(fields)
    if reseal:   # as an attacker who knows the format would
        meta[integrity.DIGEST] = integrity.seal(meta)
    (step / "meta.json").chmod(0o644)
    (step / "meta.json").write_text(json.dumps(meta))


def test_a_save_seals_meta_json(step3):
    mgr, step = step3
    meta = json.loads((step / "meta.json").read_text())
    assert meta[integrity.DIGEST] == integrity.seal(meta) and len(meta[integrity.DIGEST]) == 64
    assert mgr.load({"s": Small(0.0)})["step"] == 3


@pytest.mark.parametrize("fields", [dict(step=7), dict(world_size=2), dict(format=2),
                                    dict(extra={"data_position": 99})], ids=["step", "world_size", "format", "extra"])
def test_an_edited_meta_json_fails_its_digest_before_anything_is_read(step3, fields):
    mgr, step = step3
    _edit(step, fields, reseal=False)
    loaded = Small(0.0)
    with pytest.raises(ckpt.CheckpointCorruptError, match=rf"{step / 'meta.json'} does not match its meta_sha256"):
        mgr.load({"s": loaded}, trust_checkpoint=True)
    assert torch.equal(loaded.w, torch.zeros(4))


def test_a_resealed_step_must_equal_the_folders(step3):
    """The battery's case: meta.json said step 7 in step_000003, and the load returned step 7."""
    mgr, step = step3
    _edit(step, dict(step=7), reseal=True)
    with pytest.raises(ckpt.CheckpointError, match=r"records step 7, but its folder is step_000003 \(step 3\)"):
        mgr.load({"s": Small(0.0)})
    assert mgr.loaded_step is None


@pytest.mark.parametrize("fields, named", [
    (dict(world_size=0), r"world_size=0 is not allowed; allowed: an int >= 1"),
    (dict(world_size="2"), r"world_size='2' is not allowed"),
    (dict(tp=True), r"tp=True is not allowed"),
    (dict(format=99), r"format=99 is not one this kit reads \(allowed: 1, 2, 3, 4\)"),
    (dict(format="4"), r"format='4' is not one this kit reads"),
    (dict(step=-3), r"step=-3 is not allowed"),
    (dict(step=True), r"step=True \(bool\) is not allowed"),
    (dict(fsdp="yes"), r"fsdp='yes'"),
], ids=["world0", "world_str", "tp_bool", "format99", "format_str", "step_neg", "step_bool", "fsdp_str"])
def test_resealed_fields_are_checked_by_name(step3, fields, named):
    mgr, step = step3
    _edit(step, fields, reseal=True)
    with pytest.raises(ckpt.CheckpointError, match=named):
        mgr.load({"s": Small(0.0)}, trust_checkpoint=True)


def test_without_a_digest_only_a_trusted_load(step3):
    mgr, step = step3
    meta = json.loads((step / "meta.json").read_text())
    del meta[integrity.DIGEST]
    (step / "meta.json").chmod(0o644)
    (step / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match=r"records no meta_sha256 .*trust_checkpoint=True"):
        mgr.load({"s": Small(0.0)})
    loaded = Small(0.0)
    with pytest.warns(UserWarning, match="records no meta_sha256"):
        mgr.load({"s": loaded}, trust_checkpoint=True)
    assert torch.equal(loaded.w, torch.full((4,), 3.0))


def test_a_damaged_meta_falls_back_to_the_older_step(tmp_path):
    mgr = ckpt.CheckpointManager(tmp_path)
    mgr.save(1, {"s": Small(1.0)})
    newest = mgr.save(2, {"s": Small(2.0)})
    _edit(newest, dict(world_size=8), reseal=False)
    loaded = Small(0.0)
    with pytest.warns(UserWarning, match="instead of the damaged step_000002"):
        assert mgr.load({"s": loaded}, fallback=True)["step"] == 1
    assert torch.equal(loaded.w, torch.full((4,), 1.0))


def test_a_linked_meta_json_is_refused_unread(step3, tmp_path):
    mgr, step = step3
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(dict(json.loads((step / "meta.json").read_text()), world_size="secret words")))
    (step / "meta.json").unlink()
    (step / "meta.json").symlink_to(elsewhere)
    for trust in (False, True):
        with pytest.raises(ckpt.CheckpointError, match=rf"{step / 'meta.json'} is a symlink") as e:
            mgr.load({"s": Small(0.0)}, trust_checkpoint=trust)
        assert "secret words" not in str(e.value)
