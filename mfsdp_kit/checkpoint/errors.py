"""The two errors every checkpoint failure becomes (on every rank alike).

`CheckpointError` is defined in `models.hf`, the lowest layer that refuses saved weights (an HF folder whose tensors
do not fit its config.json), and is this package's: the same class, so `except CheckpointError` catches both
(imports point down: docs/design.md, "Layers")."""
from __future__ import annotations

from ..models.hf import CheckpointError


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's bytes are damaged: a file missing, truncated or not matching the checksum
    recorded at save, or a metadata file that cannot be read. `load(..., fallback=True)` then
    tries the next older checkpoint; any other CheckpointError (untrusted, does not fit) stops."""


__all__ = ["CheckpointCorruptError", "CheckpointError"]
