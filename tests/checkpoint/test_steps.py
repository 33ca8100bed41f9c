"""checkpoint.steps: every step argument checked at the call, `latest` read safely (issue 51 items 4 and 7)."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from mfsdp_kit import checkpoint as ckpt
from mfsdp_kit.checkpoint import steps
from tests.small_state import Small


BAD_STEPS = [("5", r"step='5' \(str\)"), (2.5, r"step=2\.5 \(float\)"), (math.nan, r"step=nan \(float\)"),
             (None, r"step=None \(NoneType\)"), (True, r"step=True \(bool\)"), (-1, r"step=-1 is not allowed"),
             (10 ** 18, r"step=1000000000000000000 is not allowed"), ("../x", r"step='\.\./x' \(str\)")]


@pytest.mark.parametrize("value, named", BAD_STEPS, ids=[repr(v) for v, _ in BAD_STEPS])
def test_save_refuses_a_bad_step_by_name(tmp_path, value, named):
    mgr = ckpt.CheckpointManager(tmp_path / "ckpt")
    with pytest.raises(ckpt.CheckpointError, match=named + r".*allowed: an int >= 0 of at most 18 digits"):
        mgr.save(value, {"s": Small()})
    assert not (tmp_path / "ckpt").exists()   # nothing written, not even the root


@pytest.mark.parametrize("value, named", BAD_STEPS, ids=[repr(v) for v, _ in BAD_STEPS])
def test_load_refuses_a_bad_step_by_name(tmp_path, value, named):
    mgr = ckpt.CheckpointManager(tmp_path)
    mgr.save(1, {"s": Small()})
    with pytest.raises(ckpt.CheckpointError, match=named + r'.*allowed: an int >= 0 of at most 18 digits or "latest"'):
        mgr.load({"s": Small(0.0)}, step=value)


def test_integer_types_are_steps_and_latest_is_a_step_for_load(tmp_path):
    mgr = ckpt.CheckpointManager(tmp_path)
    mgr.save(np.int64(2), {"s": Small(2.0)})
    mgr.save(torch.tensor(3), {"s": Small(3.0)})
    assert mgr.list() == [2, 3] and mgr.latest() == 3
    assert mgr.load({"s": Small(0.0)}, step=np.int32(2))["step"] == 2
    assert mgr.load({"s": Small(0.0)}, step="latest")["step"] == 3
    assert steps.check_step("latest", latest_ok=True) == "latest"
    with pytest.raises(ckpt.CheckpointError, match=r"step='latest' \(str\) is not allowed"):
        mgr.save("latest", {"s": Small()})
    with pytest.raises(ckpt.CheckpointError, match=r"step=True \(bool\)"):
        mgr.path(True)
    with pytest.raises(ckpt.CheckpointError, match=r"step=-3 is not allowed"):
        ckpt.step_dirname(-3)


def test_a_5000_digit_latest_is_refused_by_name(tmp_path):
    mgr = ckpt.CheckpointManager(tmp_path)
    mgr.save(1, {"s": Small()})
    (tmp_path / "latest").write_text("step_" + "9" * 5000 + "\n")
    for call in (mgr.latest, lambda: mgr.load({"s": Small(0.0)}), lambda: mgr.save(2, {"s": Small()})):
        with pytest.raises(ckpt.CheckpointError, match=r"latest holds 5006 bytes \(more than 64\), not a step"):
            call()


@pytest.mark.parametrize("name", ["step_-1", "step_3", "step_\u0663\u0660\u0660\u0660\u0660\u0660", "step_" + "1" * 19,
                                  "step_ 00001", "step_+00001"])
def test_list_takes_only_canonical_step_folders(tmp_path, name):
    mgr = ckpt.CheckpointManager(tmp_path)
    mgr.save(1, {"s": Small()})
    (tmp_path / name).mkdir()
    (tmp_path / name / "meta.json").write_text("{}")
    assert mgr.list() == [1] and steps.parse_dirname(name) is None
    (tmp_path / "latest").write_text(name + "\n")
    with pytest.raises(ckpt.CheckpointError, match=r"not a step directory name"):
        mgr.latest()


def test_a_linked_latest_is_never_read_trusted_or_not(tmp_path):
    """With trust_checkpoint=True a `latest` symlink to a file the user may read (here: one not a pointer)
    used to be read, and its first line shown in the error."""
    mgr = ckpt.CheckpointManager(tmp_path / "ckpt")
    mgr.save(1, {"s": Small()})
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret first line\n")
    pointer = tmp_path / "ckpt" / "latest"
    pointer.unlink()
    pointer.symlink_to(secret)
    for call in (mgr.latest, lambda: mgr.load({"s": Small(0.0)}, trust_checkpoint=True),
                 lambda: mgr.load({"s": Small(0.0)}), lambda: mgr.save(2, {"s": Small()}, trust_checkpoint=True)):
        with pytest.raises(ckpt.CheckpointError, match=rf"{pointer} is a symlink to '{secret}'") as e:
            call()
        assert "secret first line" not in str(e.value)


def test_a_pointer_someone_else_owns_is_not_shown(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to chown the pointer to another user")
    mgr = ckpt.CheckpointManager(tmp_path)
    mgr.save(1, {"s": Small()})
    (tmp_path / "latest").write_text("root's words\n")
    os.chown(tmp_path / "latest", 65534, 65534)
    with pytest.raises(ckpt.CheckpointError, match=r"13 bytes \(not shown: the file is owned by uid 65534") as e:
        mgr.load({"s": Small(0.0)}, trust_checkpoint=True)
    assert "root's words" not in str(e.value)
