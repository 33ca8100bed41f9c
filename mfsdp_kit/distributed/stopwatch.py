"""`Stopwatch`: host work split into phases that add up to its total (a cluster's start, a checkpoint's save and load).

The standard library alone, so the runtime and a kernel that has not imported torch yet may import it
(tests/test_layout.py, `PERF_FOR_THE_RUNTIME`).
"""
from __future__ import annotations

import time


class Stopwatch:
    """Seconds per phase of host work, in the order the phases ran: `lap("register")` closes the phase since the last
    lap. The phases are laps of one run of `perf_counter` marks, so the laps sum to `lapped()` exactly, with no
    untimed gap between two of them however loaded the machine (two separately timed phases can lose milliseconds
    between them when another thread holds the GIL). The cluster's startup record and checkpoint saves and loads use it.

    `phases`: the dict to fill (a fresh one if None); a lap of a name already there adds to it.
    `start`: the `time.perf_counter()` mark the first phase starts at (now if None).
    """

    def __init__(self, phases: dict | None = None, start: float | None = None) -> None:
        self.phases: dict[str, float] = {} if phases is None else phases
        self.start = time.perf_counter() if start is None else start
        self.last = self.start
        """The mark the next phase starts at (the last lap's)."""

    def lap(self, name: str) -> float:
        """Close phase `name` now; returns the mark (perf_counter seconds) it ended at."""
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now
        return now

    def lapped(self) -> float:
        """Seconds from the start to the last lap: the sum of the phases."""
        return self.last - self.start

    def total(self) -> float:
        """Seconds from the start to now."""
        return time.perf_counter() - self.start
