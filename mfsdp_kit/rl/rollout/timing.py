"""Where a rollout call's time goes, per batch bucket, without syncing the decode loop."""
from __future__ import annotations

import torch

from ...distributed import clock


class ChunkTimer:
    """Seconds and decode steps per batch bucket of one call, from one `clock.mark` per chunk (a CUDA event on a
    GPU: no sync until `by_batch` reads them at the call's end; the host clock elsewhere). A chunk's seconds run
    from the previous chunk's end, so they include the prefills admitted before it: where the long tail of small
    batches goes."""

    def __init__(self, device: torch.device):
        self.device = device
        self.marks: list[tuple[int, int, object]] = [(0, 0, clock.mark(device))]

    def mark(self, batch: int, steps: int) -> None:
        self.marks.append((batch, steps, clock.mark(self.device)))

    def by_batch(self) -> dict[int, dict]:
        """{batch bucket: {"steps": decode steps, "seconds": s}}, largest batch first."""
        out: dict[int, dict] = {}
        for (_, _, t0), (batch, steps, t1) in zip(self.marks, self.marks[1:]):
            row = out.setdefault(batch, dict(steps=0, seconds=0.0))
            row["steps"] += steps
            row["seconds"] += clock.seconds_between(t0, t1)
        return dict(sorted(out.items(), reverse=True))
