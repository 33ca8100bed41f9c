"""Stop as a pause: the notebook's Stop button ends the kit's loops at one step boundary that every rank agrees on.

The naive version is Python's own: SIGINT raises KeyboardInterrupt wherever each rank happens to be. On two
ranks that is rank 0 between two all-reduces and rank 1 inside one, or one rank past the optimizer step and the
other before it. Measured with `02_sft` on 2 gloo engines (issue 69): after Stop, 9 presses in 11 left an engine
waiting in a collective forever or a model that failed on its next step.

Here, while a kit loop runs on a notebook engine (`stoppable`: `train.fit`, the RL loops, a rollout, a checkpoint
save), SIGINT only raises a flag. At each step boundary the loop asks `agreed()`: an all-reduce (MAX) of the flag
over a gloo group of the whole world -- on the CPU, so an NCCL job's GPU stream never waits for it (one int, a
fraction of a millisecond on loopback). Every rank gets the same answer at the same boundary and leaves there, with
the model, optimizer, scheduler and data iterator as they are between two steps. `record` keeps where it stopped;
the notebook reads it (`take`) and prints one line for every rank.

A second SIGINT while the flag is up raises KeyboardInterrupt as Python would: the escalation. A rank that waits in
a collective runs no Python handler, so the notebook then also aborts the world's process groups
(`notebook/watchdog.py`).

Only engines arm this (`enable`, from `cluster.start`'s engine init): under torchrun and in scripts Ctrl-C stays
Python's KeyboardInterrupt, `stoppable` changes nothing and `agreed()` is False without a collective.
"""
from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterator

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Stopped:
    """Where a kit loop left after Stop: the same on every rank."""

    what: str
    """The loop, e.g. "train.fit" or "grpo"."""
    step: int
    """Steps done when it left (counting from the loop's `start_step`'s origin: the next step's index)."""
    total: int
    """The step the loop would have ended at."""
    resume: str = ""
    """How to go on from there, e.g. "fit(..., start_step=37, steps=113)"."""

    def line(self) -> str:
        """The one line a notebook prints."""
        tail = f"; {self.resume} continues" if self.resume else ""
        return f"{self.what}: stopped at step {self.step} of {self.total} on every rank (History kept{tail})"


_enabled = False
_group = None
"""The gloo group `agreed` all-reduces over (the world's own group where the world is gloo)."""
_requested_at: float | None = None
"""When this rank's first SIGINT came (time.monotonic), None while no Stop is pending."""
_depth = 0
_last: Stopped | None = None


def enable() -> None:
    """Arm Stop-as-pause on this rank (collective: every rank calls it once per world, after `runtime.init`)."""
    global _enabled, _group
    _enabled = True
    clear()
    if dist.is_initialized() and dist.get_world_size() > 1:
        _group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


def enabled() -> bool:
    return _enabled


def disable() -> None:
    """Back to Python's own Ctrl-C on this process (an engine leaving the kit's world, a test)."""
    global _enabled, _group
    _enabled, _group = False, None
    clear()


def _on_sigint(signum, frame) -> None:
    global _requested_at
    if _requested_at is not None:   # the second Stop: Python's KeyboardInterrupt (the notebook aborts the world)
        raise KeyboardInterrupt
    _requested_at = time.monotonic()


@contextmanager
def stoppable(*, then_interrupt: str | None = None) -> Iterator[None]:
    """While inside, SIGINT asks the loop to stop at its next `agreed()` boundary instead of raising (main thread of
    an armed engine only; nested uses share the outermost handler).

    then_interrupt: the name of work with no boundary inside (a checkpoint save, a rollout: both hold collectives).
    It finishes whole; then, if Stop came meanwhile and no kit loop encloses it, KeyboardInterrupt is raised as
    Python would have raised it, only after the work, saying so: a save is committed or was never begun. Inside a
    loop, the loop stops at its next boundary instead."""
    global _depth
    if not _enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _on_sigint) if _depth == 0 else None
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if then_interrupt and previous is not None and requested():
        clear()
        raise KeyboardInterrupt(f"Stop came during {then_interrupt}, which finished first")


def requested() -> bool:
    """Has this rank been asked to stop (its own flag; `agreed` is the world's)?"""
    return _requested_at is not None


def agreed() -> bool:
    """Has any rank been asked to stop? Collective over the world: every rank calls it at the same boundary."""
    if not _enabled:
        return False
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return requested()
    flag = torch.tensor([int(requested())], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_group)
    return bool(flag.item())


def record(*, what: str, step: int, total: int, resume: str = "") -> Stopped:
    """Note where a loop left after `agreed()` said stop; `take` hands it to the notebook."""
    global _last
    _last = Stopped(what=what, step=step, total=total, resume=resume)
    return _last


def take() -> dict | None:
    """Where the last loop stopped (as a dict, for the notebook) or None; clears the flag and the record, so the
    next cell starts without a pending Stop."""
    last = _last
    clear()
    return None if last is None else asdict(last)


def clear() -> None:
    global _requested_at, _last
    _requested_at, _last = None, None
