"""`Stopwatch`: seconds per phase from one run of contiguous `perf_counter` marks.

Each `lap` closes the phase since the previous lap, so the phases partition the span from the start
to the last lap: their sum is `lapped()` exactly, with no untimed gap between two phases however loaded
the machine is (a gap between two separately timed phases can reach milliseconds when another thread
holds the GIL). Used by the cluster's startup record and by checkpoint saves and loads.
"""
from __future__ import annotations

import time


class Stopwatch:
    """Seconds per phase, in the order the phases ran: `lap("register")` closes the phase since the last lap.

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
