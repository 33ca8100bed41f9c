"""A folder that appears whole or not at all: written into a hidden sibling, then renamed into place.

The kit writes three folders a reader must never see half-written: a peft adapter folder
(`adapters.save_adapter`), a tiny model in the machine's cache (`models.tiny.cached`) and a checkpoint step
(`checkpoint.commit`, which adds checksums, fsyncs, write bits and the `latest` pointer under a lock). A rename
within one directory is atomic on POSIX file systems, so each writes aside and renames; this module is that
mechanism, once: `aside` (a fresh sibling), `place` (the rename, with the policy for a folder already at the
destination), `discard` (a half-written folder removed), and `written_aside`, the three as one `with`.

A folder already at the destination, by `place(..., replace=)`:
- False: the rename fails (OSError) when a non-empty folder is there; an empty one is replaced (rename(2)).
  What that means is the caller's: a tiny model another process wrote meanwhile is as good as this one; a
  checkpoint step must be new.
- True: the earlier folder is renamed aside, the new one renamed in, then the earlier one deleted. A reader sees
  the earlier folder or the new one (between the two renames: none), never a mix of their files.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def aside(path, *, mode: int | None = None) -> Path:
    """A new, empty hidden sibling of `path` (`.<name>.<random>`) to write the folder into; `path`'s parent is
    created. mkdtemp picks a name nobody else holds, so two writers of one folder never share files. `mode`:
    its permission bits (mkdtemp's are 0o700, which hides the folder from other users once it is renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    if mode is not None:
        os.chmod(tmp, mode)
    return tmp


def place(tmp, path, *, replace: bool) -> Path:
    """Rename the written folder `tmp` to `path` (its sibling); a folder already there as the module docstring
    says (`replace`). Returns `path`."""
    tmp, path = Path(tmp), Path(path)
    old = None
    if replace and path.exists():
        old = path.with_name(f"{tmp.name}.old")   # tmp's random name: no other writer's
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        discard(old)
    return path


def discard(tmp) -> None:
    """Remove a folder that was not placed (a failed or lost write); a missing one is no error."""
    shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def written_aside(path, *, replace: bool, mode: int | None = None) -> Iterator[Path]:
    """`with written_aside(path, replace=...) as tmp:` write the folder's files into `tmp`; when the block ends
    without an exception it is placed at `path` (`place`), and either way nothing of `tmp` is left behind."""
    tmp = aside(path, mode=mode)
    try:
        yield tmp
        place(tmp, path, replace=replace)
    finally:
        discard(tmp)
