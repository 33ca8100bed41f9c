"""Where a rollout call's time goes, per batch bucket and per kind of launch, without syncing the decode loop."""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from ...distributed import clock


class CallTimer:
    """One call's time, into its `stats`: seconds and decode steps per batch bucket from one `clock.mark` per chunk
    (a CUDA event on a GPU: no sync until `by_batch` reads them at the call's end; the host clock elsewhere), and the
    host seconds of its prefills and extends (`phase`). A chunk's seconds run from the previous chunk's end, so they
    include the prefills admitted before it: where the long tail of small batches goes."""

    def __init__(self, device: torch.device, stats: dict):
        self.device, self.stats = device, stats
        self.marks: list[tuple[int, int, object]] = [(0, 0, clock.mark(device))]

    def chunk(self, batch: int, steps: int) -> None:
        """A chunk of `steps` decode steps at batch bucket `batch` has ended (`stats["steps"]` counts them)."""
        self.marks.append((batch, steps, clock.mark(self.device)))
        self.stats["steps"] = self.stats.get("steps", 0) + steps

    @contextmanager
    def phase(self, key: str):
        """The block's host seconds added to `stats[key]` ("prefill_s", "extend_s")."""
        t0 = time.perf_counter()
        yield
        self.stats[key] = self.stats.get(key, 0.0) + time.perf_counter() - t0

    def by_batch(self) -> dict[int, dict]:
        """{batch bucket: {"steps": decode steps, "seconds": s}}, largest batch first."""
        out: dict[int, dict] = {}
        for (_, _, t0), (batch, steps, t1) in zip(self.marks, self.marks[1:]):
            row = out.setdefault(batch, dict(steps=0, seconds=0.0))
            row["steps"] += steps
            row["seconds"] += clock.seconds_between(t0, t1)
        return dict(sorted(out.items(), reverse=True))
