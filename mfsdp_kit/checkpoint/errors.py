"""The two errors every checkpoint failure becomes (on every rank alike)."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, untrusted, does not fit the model, or could not be
    written; the message names the path and what to do."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's bytes are damaged: a file missing, truncated or not matching the checksum
    recorded at save, or a metadata file that cannot be read. `load(..., fallback=True)` then
    tries the next older checkpoint; any other CheckpointError (untrusted, does not fit) stops."""
