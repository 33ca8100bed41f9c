"""Step numbers and the `latest` pointer: checked at every door, moved under a lock, never backwards.

A step is a non-negative int of at most MAX_STEP_DIGITS digits. The naive `f"step_{step:06d}"` takes
whatever it is given: `True` saves step 1, `"5"` and `2.5` fail with "Unknown format code 'd'", and
`int()` of a 5000-digit `latest` fails with Python's "Exceeds the limit (4300 digits)". So every step
argument goes through `check_step` at the call, and every step read from disk (a folder name, the
pointer) through `parse_dirname`, which accepts only the canonical `step_%06d` form in ASCII digits.

`latest` is read with O_NOFOLLOW (a symlink there is refused by name; the file it points to is never
read, so none of it can appear in an error), at most POINTER_BYTES of it, and its text is shown in an
error only when the file is yours.

Moving `latest`: two savers into one root each checked "not below `latest`" at the start of their save,
then both moved it at their commit, so the slower one could move it back (`latest` 59 while step 60
exists; the next load resumes from the older step). `publish` renames the step folder into place and
moves `latest` under an exclusive `fcntl.flock` on LOCK_NAME in the root (created O_NOFOLLOW, never
removed: removing a lock file others wait on breaks the lock), re-reading `latest` inside the lock.
"""
from __future__ import annotations

import fcntl
import operator
import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .. import folders
from .errors import CheckpointError
from .trust import symlink

LATEST = "latest"
LOCK_NAME = ".latest.lock"
"""The file in a checkpoint root whose flock serialises moving `latest`."""
PREFIX = "step_"
MAX_STEP_DIGITS = 18
"""A step has at most 18 digits (below 2**63: it fits any int64 counter)."""
POINTER_BYTES = 64
"""`latest` holds `step_` + at most 18 digits + a newline: 24 bytes; more is refused unread."""


def check_step(step, *, what: str = "step", latest_ok: bool = False):
    """`step` as an int (or "latest" where `latest_ok`); CheckpointError naming `what`, the value and what
    is allowed. Refused: bool (True is not step 1), str, float (2.5, nan), None, negatives, > 18 digits."""
    allowed = f"an int >= 0 of at most {MAX_STEP_DIGITS} digits" + (' or "latest"' if latest_ok else "")
    if latest_ok and isinstance(step, str) and step == LATEST:
        return step
    try:
        if isinstance(step, (bool, str, bytes, float)):
            raise TypeError
        value = operator.index(step)   # int, numpy / torch integers
    except TypeError:
        raise CheckpointError(f"{what}={_short(step)} ({type(step).__name__}) is not allowed; allowed: {allowed}") from None
    if value < 0 or value >= 10 ** MAX_STEP_DIGITS:
        raise CheckpointError(f"{what}={_short(value)} is not allowed; allowed: {allowed}")
    return value


def _short(value, limit: int = 60) -> str:
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else f"<an int of {value.bit_length()} bits>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def step_dirname(step: int) -> str:
    """`step_000010` for step 10 (`check_step` first: no bool, str or float becomes a folder name)."""
    return f"{PREFIX}{check_step(step):06d}"


def parse_dirname(name: str) -> int | None:
    """The step of a folder name `step_%06d` (ASCII digits, canonical: `step_3` and `step_٣` are not); else None."""
    digits = name[len(PREFIX):] if name.startswith(PREFIX) else ""
    if not (0 < len(digits) <= MAX_STEP_DIGITS and digits.isascii() and digits.isdigit()):
        return None
    step = int(digits)
    return step if f"{PREFIX}{step:06d}" == name else None


def read_latest(root: Path) -> int | None:
    """The step `root/latest` names; None when there is none (or it is not a file: a directory there fails
    the commit, by name). A symlink is refused unread (`trust.symlink`)."""
    pointer = Path(root) / LATEST
    try:
        fd = os.open(pointer, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        if os.path.islink(pointer):
            raise symlink(pointer) from None
        raise CheckpointError(f"cannot read {pointer}: {e}") from None
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode):
        os.close(fd)
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{pointer} is not a regular file ({stat.filemode(st.st_mode)}): `latest` is a "
                                  "file a save writes; remove it")
        data = f.read(POINTER_BYTES + 1)
    name = data.decode("utf-8", "replace").strip()
    step = parse_dirname(name) if len(data) <= POINTER_BYTES else None
    if step is not None:
        return step
    if len(data) > POINTER_BYTES:
        shown = f"{st.st_size} bytes (more than {POINTER_BYTES})"
    elif st.st_uid == os.geteuid():
        shown = _short(name)
    else:
        shown = f"{len(data)} bytes (not shown: the file is owned by uid {st.st_uid}, not by you)"
    raise CheckpointError(f"{pointer} holds {shown}, not a step directory name (step_ and at most "
                          f"{MAX_STEP_DIGITS} digits); delete it, or write the name of a step folder into it")


@contextmanager
def locked(root: Path, *, shared: bool = False):
    """An exclusive (`shared`: a shared) `fcntl.flock` on `root/LOCK_NAME`, opened O_NOFOLLOW (a planted link
    is refused). A reader that holds it shared sees `latest` and the step folders of one moment."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(Path(root) / LOCK_NAME, flags, 0o644)
    except OSError:
        if os.path.islink(Path(root) / LOCK_NAME):
            raise symlink(Path(root) / LOCK_NAME, "save") from None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # releases the lock


def backwards(step: int, latest: int, root: Path) -> str:
    """Why a save of `step` is refused while `latest` names the higher `latest`."""
    return (f"step {step} is lower than the latest checkpoint's ({latest}, in {Path(root) / LATEST}): saving it "
            "would move `latest` backwards, so that the next load resumes from the older step. Pass "
            "allow_backwards=True if that is what you want (you loaded an older step and retrain from it)")


def publish(tmp: Path, final: Path, *, allow_backwards: bool, fsync_dir) -> None:
    """Under the root's lock: `latest` re-read (a later step published meanwhile refuses this one, by name,
    unless `allow_backwards`), `tmp` renamed to `final`, `latest` := final's name. On failure `final` is back
    at `tmp` (not committed). `fsync_dir(path)` makes the rename and the pointer durable."""
    root = final.parent
    step = parse_dirname(final.name)
    with locked(root):
        latest = read_latest(root)
        if not allow_backwards and latest is not None and step < latest:
            raise CheckpointError(f"another save published step {latest} while this one wrote; "
                                  + backwards(step, latest, root))
        folders.place(tmp, final, replace=False)   # never over a step: prepare checked it is new
        pointer = None
        try:
            # a fresh random name (mkstemp: O_EXCL | O_NOFOLLOW), not a fixed `latest.tmp` someone could plant
            fd, name = tempfile.mkstemp(prefix=f".{LATEST}-", dir=root)
            pointer = Path(name)
            with os.fdopen(fd, "w") as f:
                f.write(final.name + "\n")
            os.chmod(pointer, 0o644)   # mkstemp's 0600 hides nothing here, and other readers may list steps
            os.replace(pointer, root / LATEST)   # replaces a link named `latest` itself, never its target
            fsync_dir(root)
        except OSError:
            if pointer is not None:
                pointer.unlink(missing_ok=True)
            os.replace(final, tmp)
            raise
