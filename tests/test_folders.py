"""`folders`: a folder written aside appears whole on success, nothing is left of a failed write, and a folder
already at the destination is replaced or refused as asked."""
import os
import stat

import pytest

from mfsdp_kit import folders


def names(path):
    return sorted(p.name for p in path.iterdir())


def test_success_places_the_whole_folder_and_leaves_no_sibling(tmp_path):
    dest = tmp_path / "new" / "out"   # the parent is made
    with folders.written_aside(dest, replace=False) as tmp:
        assert tmp.parent == dest.parent and tmp.name.startswith(".out.") and not dest.exists()
        (tmp / "a.txt").write_text("a")
        (tmp / "b.txt").write_text("b")
    assert names(dest) == ["a.txt", "b.txt"]
    assert names(dest.parent) == ["out"]


def test_failure_leaves_nothing_half_written(tmp_path):
    dest = tmp_path / "out"
    with pytest.raises(RuntimeError, match="midway"):
        with folders.written_aside(dest, replace=True) as tmp:
            (tmp / "a.txt").write_text("a")
            raise RuntimeError("midway")
    assert names(tmp_path) == []


@pytest.mark.parametrize("replace, error", [(True, RuntimeError), (False, OSError)], ids=["failed", "refused"])
def test_a_failed_or_refused_write_keeps_the_earlier_folder(tmp_path, replace, error):
    """replace=True: the block fails midway; replace=False: the block succeeds but a non-empty folder is there."""
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with pytest.raises(error):
        with folders.written_aside(dest, replace=replace) as tmp:
            (tmp / "new.txt").write_text("new")
            if replace:
                raise RuntimeError("midway")
    assert names(tmp_path) == ["out"] and names(dest) == ["old.txt"]


def test_replace_true_swaps_the_earlier_folder_out_whole(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with folders.written_aside(dest, replace=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert names(dest) == ["new.txt"]   # no file of the earlier folder is mixed in
    assert names(tmp_path) == ["out"]   # the earlier folder, moved aside, is gone


def test_replace_false_takes_an_empty_folder(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    with folders.written_aside(dest, replace=False) as tmp:
        (tmp / "mine.txt").write_text("mine")
    assert names(dest) == ["mine.txt"]


def test_mode_and_the_explicit_steps(tmp_path):
    tmp = folders.aside(tmp_path / "out", mode=0o755)
    assert stat.S_IMODE(os.stat(tmp).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(folders.aside(tmp_path / "other")).st_mode) == 0o700   # mkdtemp's, by default
    assert folders.place(tmp, tmp_path / "out", replace=False) == tmp_path / "out" and not tmp.exists()
    folders.discard(tmp)   # gone already: no error
    folders.discard(tmp_path / "out")
    assert not (tmp_path / "out").exists()
