"""Rank 0's commit of a written checkpoint directory, and the removal of old checkpoints.

The commit makes a checkpoint visible only once it is complete: `<name>.json` of the JSON
components, checksums of the files the writer threads did not hash (`.metadata`, those JSON
files), meta.json last, group/other write bits dropped, fsyncs, `os.replace(.tmp-step_X,
step_X)`, then `latest` (written aside, `os.replace`d), both under the root's lock (`steps.publish`). A commit that fails before `latest`
moved is rolled back (step_X goes back to .tmp-step_X).

Removal (`keep_last`). The naive prune, `shutil.rmtree` of each old step right after the
commit, charges the save with freeing the old checkpoint's pages: on tmpfs 0.15-0.32 s per GiB
on this 2-core VM (2 GiB: 0.32 s), i.e. a 4 GB checkpoint costs about as long to delete as to
write. Here an old step is renamed to `.trash-step_X` (atomic: `list()`, `latest` and a load no
longer see it) and deleted by a background thread. A new removal first waits for the previous
one, so deletions never pile up; the thread is not a daemon, so the interpreter finishes it
before it exits; a `.trash-*` left by a killed process is deleted with the next removal.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from . import integrity, steps, storage, trust
from .errors import CheckpointError
from .restore import DCP_METADATA

LATEST = steps.LATEST
TRASH = ".trash-"
"""Prefix of a removed step's directory while a background thread deletes it."""


def commit(tmp: Path, final: Path, meta: dict, as_json: dict, sums: dict, *, start: float,
           allow_backwards: bool = False) -> dict:
    """Rank 0: `<name>.json` per JSON component, checksums, meta.json (last), rename, move `latest`.

    `sums`: {file: {bytes, crc32}} the writer threads hashed; `start`: perf_counter() seconds at
    the save's start (meta.json's time_to_write_s). The rename and `latest` happen under the root's lock
    (`steps.publish`): a later step published meanwhile refuses this one unless `allow_backwards`. Returns this commit's seconds: files (JSON
    files, checksums of the small files, meta.json), sync (.metadata's fsync, write bits, the
    directory's fsync), publish (the rename and `latest`).
    """
    t0 = time.perf_counter()
    try:
        for name, value in as_json.items():
            storage.write_json(tmp / f"{name}.json", value)
        names = sorted(p.name for p in tmp.iterdir())
        sums.update(integrity.checksums(tmp, [n for n in names if n not in sums]))
        meta.update(files=names, checksums={n: sums[n] for n in names},
                    bytes=sum(sums[n]["bytes"] for n in names), time_to_write_s=time.perf_counter() - start)
        t1 = time.perf_counter()
        storage.fsync_file(tmp / DCP_METADATA)  # DCP's finish() skips it: sync_files=False
        meta[integrity.DIGEST] = integrity.seal(meta)   # meta.json's own checksum, over every file's too
        storage.write_json(tmp / integrity.META, meta)
        storage.harden(tmp)
        storage.fsync_dir(tmp)
        t2 = time.perf_counter()
        steps.publish(tmp, final, allow_backwards=allow_backwards, fsync_dir=storage.fsync_dir)
    except OSError as e:
        raise CheckpointError(f"committing checkpoint {final} failed: {e}") from e
    return dict(files=t1 - t0, sync=t2 - t1, publish=time.perf_counter() - t2)


def prepare(root: Path, tmp: Path, final: Path, *, trust_checkpoint: bool, allow_backwards: bool) -> str | None:
    """Rank 0, before any collective write: the root trusted (`trust.check_save`) and writable, the step
    new (and not below `latest` unless `allow_backwards`), a stale tmp gone. Error text or None."""
    try:
        if not trust_checkpoint and os.path.lexists(root):
            trust.check_save(root, [LATEST, steps.LOCK_NAME, tmp.name, final.name])
        root.mkdir(mode=0o755, parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=root)   # a fresh name: a planted link is never followed
        try:
            with os.fdopen(fd, "wb") as f:   # a byte, so a full disk fails here, before any rank writes
                f.write(b"ok")
                f.flush()
        finally:
            os.unlink(probe)
        if os.path.lexists(final):
            return f"checkpoint {final} already exists; save under another step or delete it first"
        latest = steps.read_latest(root)   # checked again under the lock at the commit (`steps.publish`)
        if not allow_backwards and latest is not None and steps.parse_dirname(final.name) < latest:
            return steps.backwards(steps.parse_dirname(final.name), latest, root)
        if tmp.is_symlink():
            raise trust.symlink(tmp, "save")
        if tmp.exists():  # left by a save that was killed
            shutil.rmtree(tmp)
        tmp.mkdir(mode=0o755)   # nobody else may add files to what is being written
    except OSError as e:
        return f"cannot write checkpoints under {root}: {e}"
    except CheckpointError as e:
        return str(e)
    return None


class Remover:
    """Deletes old checkpoint directories in a background thread (see the module docstring)."""

    def __init__(self):
        self.thread: threading.Thread | None = None

    def remove(self, root: Path, paths: list) -> None:
        """Rename each of `paths` to `.trash-<name>` now, delete them (and stale `.trash-*`) later."""
        self.wait()
        for p in paths:
            try:
                os.replace(p, root / f"{TRASH}{p.name}")
            except OSError:  # gone already, or not renamable: delete it in place
                shutil.rmtree(p, ignore_errors=True)
        trash = [p for p in root.iterdir() if p.name.startswith(TRASH)]
        if trash:
            self.thread = threading.Thread(target=_delete, args=(trash,), name="mfsdp-ckpt-remove")
            self.thread.start()

    def wait(self) -> None:
        """Block until the last removal's files are gone."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None


def _delete(paths: list) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
