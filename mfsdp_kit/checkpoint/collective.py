"""Ranks agree on every outcome: the checkpoint code's only collectives besides DCP's own.

The naive way to report a failure is to raise where it happens. In a collective save or load that
hangs the job: the failing rank leaves, the others wait in the next collective until the process
group times out (76 s to 600 s). So every phase of a save or load runs inside `agreed(...)`:
each rank catches its own error, one `all_gather_object` tells every rank about every rank's
error, and every rank raises the same `CheckpointError` (or none does). torch DCP's
`CheckpointException` derives from BaseException (not Exception), so it is caught by name.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..distributed.runtime import broadcast  # noqa: F401  (collective.broadcast: rank 0's object on every rank)
from .errors import CheckpointCorruptError, CheckpointError

ERROR_CHARS = 2000
"""Each rank's error text is cut to this many characters in the shared message."""


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def world() -> int:
    return dist.get_world_size() if initialized() else 1


def all_gather(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not initialized():
        return [obj]
    out = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def describe(error: BaseException) -> str:
    """One line per failure; DCP's CheckpointException is unpacked into its per-rank errors
    (its own str is a multi-page traceback)."""
    if isinstance(error, CheckpointException):
        return "; ".join(f"DCP rank {r}: {type(e).__name__}: {e}" for r, (e, _) in error.failures.items())
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


def is_corrupt(error: BaseException) -> bool:
    """Damaged bytes: a CheckpointCorruptError, or DCP's CheckpointException of only those."""
    if isinstance(error, CheckpointException):
        return bool(error.failures) and all(isinstance(e, CheckpointCorruptError) for e, _ in error.failures.values())
    return isinstance(error, CheckpointCorruptError)


@dataclass
class Outcome:
    """What `agreed` hands the block: set `value`; after the block, `values` holds every rank's."""
    value: object = None
    values: list = field(default_factory=list)


@contextmanager
def agreed(what: str, path):
    """Run the block on every rank; if it raised on any rank, raise on every rank.

    The raised error names `what`, `path`, and each failed rank with its error. It is a
    CheckpointCorruptError when every failure was one (damaged bytes), else a CheckpointError.
    The block must not run collectives that a failed rank could skip (DCP's own are fine: DCP
    agrees internally and raises CheckpointException on every rank).
    """
    outcome, error = Outcome(), None
    try:
        yield outcome
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - every rank must learn of it
        error = e
    mine = None if error is None else (describe(error)[:ERROR_CHARS], is_corrupt(error))
    everyone = all_gather((mine, outcome.value))
    failures = [(r, m) for r, (m, _) in enumerate(everyone) if m is not None]
    outcome.values = [v for _, v in everyone]
    if failures:
        kind = CheckpointCorruptError if all(corrupt for _, (_, corrupt) in failures) else CheckpointError
        detail = "; ".join(f"{_ranks(rs)}: {text}" for text, rs in _by_text(failures).items())
        raise kind(f"{what} {path} failed on {len(failures)} of {len(everyone)} rank(s): {detail}") from error


def _by_text(failures: list) -> dict:
    """{error text: [ranks]}: an error every rank hit alike is printed once."""
    out: dict = {}
    for r, (text, _) in failures:
        out.setdefault(text, []).append(r)
    return out


def _ranks(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


_GLOO_GROUPS: dict = {}


def gloo_group():
    """A gloo group over all ranks for DCP's background coordination (created collectively, once)."""
    if not initialized():
        return None
    key = id(dist.distributed_c10d._get_default_group())
    if key not in _GLOO_GROUPS:
        _GLOO_GROUPS.clear()  # groups of a destroyed world are gone with it
        _GLOO_GROUPS[key] = dist.new_group(backend="gloo")
    return _GLOO_GROUPS[key]
