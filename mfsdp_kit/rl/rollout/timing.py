"""Where a rollout call's time goes, per batch bucket, without syncing the decode loop."""
from __future__ import annotations

import time

import torch


class ChunkTimer:
    """Seconds and decode steps per batch bucket of one call, from one CUDA event per chunk on a GPU (no sync until
    `by_batch` reads them at the call's end), the host clock elsewhere. A chunk's seconds run from the previous
    chunk's end, so they include the prefills admitted before it: where the long tail of small batches goes."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[int, int, object]] = [(0, 0, self._now())]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, batch: int, steps: int) -> None:
        self.marks.append((batch, steps, self._now()))

    def by_batch(self) -> dict[int, dict]:
        """{batch bucket: {"steps": decode steps, "seconds": s}}, largest batch first."""
        out: dict[int, dict] = {}
        for (_, _, t0), (batch, steps, t1) in zip(self.marks, self.marks[1:]):
            if self.cuda:
                t1.synchronize()
            seconds = t0.elapsed_time(t1) / 1e3 if self.cuda else t1 - t0
            row = out.setdefault(batch, dict(steps=0, seconds=0.0))
            row["steps"] += steps
            row["seconds"] += seconds
        return dict(sorted(out.items(), reverse=True))
