"""checkpoint.commit: old steps leave the listing at once and their files go in the background."""
from __future__ import annotations

import time

import pytest
import torch

from mfsdp_kit import checkpoint as ckpt
from mfsdp_kit.checkpoint import commit, restore, storage


def _step(root, name: str, nbytes: int = 1 << 20):
    d = root / name
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"\0" * nbytes)
    (d / "meta.json").write_text("{}")
    return d


def test_removed_steps_vanish_at_once_and_are_deleted_later(tmp_path):
    old, kept = _step(tmp_path, "step_000001"), _step(tmp_path, "step_000002")
    stale = _step(tmp_path, f"{commit.TRASH}step_000000")  # left by a killed process
    remover = commit.Remover()
    remover.remove(tmp_path, [old])
    assert not old.exists() and ckpt.CheckpointManager(tmp_path).list() == [2]
    remover.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002"] and kept.is_dir() and not stale.exists()


def test_a_removal_waits_for_the_previous_one(tmp_path):
    remover = commit.Remover()
    remover.remove(tmp_path, [_step(tmp_path, "step_000001")])
    first = remover.thread
    remover.remove(tmp_path, [_step(tmp_path, "step_000002")])
    assert first is not None and not first.is_alive()
    remover.wait()
    assert list(tmp_path.iterdir()) == []


def test_keep_last_prunes_in_the_background(tmp_path):
    mgr = ckpt.CheckpointManager(tmp_path, keep_last=1)
    for step in (1, 2, 3):
        mgr.save(step, {"t": _Tensor(step)})
        assert mgr.list() == [step] and mgr.latest() == step
        assert set(mgr.last_save_phases_s) >= {"commit.prune", "commit.files", "commit.publish"}
    mgr.save(4, {"t": _Tensor(4)})
    mgr.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".latest.lock", "latest", "step_000004"]


def _top(phases: dict) -> dict:
    return {k: v for k, v in phases.items() if "." not in k and k not in storage.PER_FILE}


def test_phases_add_up_to_the_save_and_the_load(tmp_path):
    """The phases are laps of one stopwatch: they cover the total with no untimed gap, however loaded the machine."""
    mgr = ckpt.CheckpointManager(tmp_path, host_staging=True, write_threads=2, read_threads=2)
    mgr.save(1, {"t": _Tensor(1)})
    top = _top(mgr.last_save_phases_s)
    assert list(top) == ["state", "stage", "write", "commit"] and min(top.values()) >= 0
    assert abs(sum(top.values()) - mgr.last_save_s) < 1e-6
    write_parts = ("write.plan", "write.data", "write.finish", "write.rest")
    assert abs(sum(mgr.last_save_phases_s[k] for k in write_parts) - top["write"]) < 1e-6
    mgr.load({"t": _Tensor(0)})
    load = mgr.last_load_phases_s
    assert list(_top(load)) == ["find", "check", "match", "read", "restore"]
    assert 0 < load["check.checksum"] <= load["check"]   # every file's crc32, shard files included, is a part of check
    assert abs(sum(_top(load).values()) - mgr.last_load_s) < 1e-6
    read_parts = ("read.plan", "read.data", "read.finish", "read.wait_peers")
    assert abs(sum(load[k] for k in read_parts) - load["read"]) < 1e-6


def test_a_fallback_load_counts_the_damaged_step_in_find(tmp_path, monkeypatch):
    """A shard of the newest step is damaged, so its try fails in `check` (crc32 before any tensor is read): that
    lap counts in `find` (the search for an intact step), and the loaded step's phases are its own."""
    mgr = ckpt.CheckpointManager(tmp_path)
    mgr.save(1, {"t": _Tensor(1)})
    mgr.save(2, {"t": _Tensor(2)})
    shard = next((tmp_path / "step_000002").glob("*.distcp"))
    shard.chmod(0o644)
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x10
    shard.write_bytes(bytes(data))
    verify, calls = restore.integrity.verify, []

    def slow_first_check(*args, **kwargs):   # the damaged try's check phase takes 0.2 s more
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.2)
        return verify(*args, **kwargs)
    monkeypatch.setattr(restore.integrity, "verify", slow_first_check)
    with pytest.warns(UserWarning, match="instead of the damaged step_000002"):
        info = mgr.load({"t": _Tensor(0)}, fallback=True)
    load = mgr.last_load_phases_s
    assert info["step"] == 1 and len(calls) == 2 and list(_top(load)) == ["find", "check", "match", "read", "restore"]
    assert load["find"] >= 0.2 > load["check"]
    assert abs(sum(_top(load).values()) - mgr.last_load_s) < 1e-6


def test_host_staging_is_opt_in(tmp_path):
    assert ckpt.CheckpointManager(tmp_path).host_staging is False
    assert ckpt.CheckpointManager(tmp_path, host_staging=True).host_staging is True
    assert ckpt.CheckpointManager(tmp_path, host_staging=False).host_staging is False


class _Tensor:
    """A Stateful holding one tensor of 3 MB (a few files' worth for 2 writer threads)."""

    def __init__(self, value: int):
        self.t = torch.full((3 << 20,), value, dtype=torch.uint8)

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, state_dict):
        self.t.copy_(state_dict["t"])
