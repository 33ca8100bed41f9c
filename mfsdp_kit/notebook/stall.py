"""Client side of a cell's status: each rank's state, and a stuck collective or a frozen rank named, not waited on.

The hang this is for: `if rank == 0: dist.barrier()`. Rank 1 finishes the cell, rank 0 waits for a peer that never
comes, and the cell returns only when the collective's timeout (10 minutes by default) raises. Nothing failed, so the
watchdog (which acts on a rank that *raised*) has nothing to act on, and the notebook said nothing for 10 minutes.

Here the client reads every rank's heartbeat record (`heartbeat.py`, once a second) and the cell's per-engine
replies. A rank is
- `done` / `running` / `idle`: by the cell's reply;
- `stuck`: running, and its main thread has stood at one instruction for `stall_s` (default 30 s) with no progress
  report meanwhile -- a collective with the collective's name, else wherever it stands;
- `frozen`: its record has not changed for `stall_s` while its process is alive (SIGSTOP, a debugger, a C call
  holding the GIL): ipyparallel later calls such an engine dead, the kit says what it is;
- `dead`: its engine is gone.
When a rank is stuck or frozen while another has finished the cell or is stuck too, the guard of that cell
(`watchdog.guard`) prints `report`: who is done, who is stuck where, each stuck rank's stack. Nothing is aborted
until the user says so (Stop twice, `handle.abort()`) or an opt-in `timeout_s` passes.
"""
from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from typing import Any

from . import heartbeat

STALL_S = 30.0
"""Seconds without a move before a rank counts as stuck or frozen (`cluster.start(stall_s=)`)."""


class Monitor:
    """The client's view of the ranks' heartbeat records (one store connection per world)."""

    def __init__(self, *, addr: str, port: int, prefix: str, ranks: list[int], idents: dict[int, dict],
                 stall_s: float = STALL_S):
        import torch.distributed as dist
        self.store = dist.TCPStore(addr, port, None, False, timeout=timedelta(seconds=5), wait_for_workers=False)
        self.prefix, self.ranks, self.idents, self.stall_s = prefix, ranks, idents, stall_s
        self._seen: dict[int, tuple[int, float]] = {}   # rank -> (seq, client monotonic time it first showed)
        self.last: dict[int, dict] = {}

    def read(self) -> dict[int, dict]:
        """Every rank's last record, with `beat_age_s`: seconds (client clock) since its record last changed."""
        now = time.monotonic()
        for rank in self.ranks:
            try:
                rec = json.loads(self.store.get(heartbeat.key(self.prefix, rank)))
            except Exception:  # noqa: BLE001 -- rank 0's store is gone: keep what was last seen
                rec = self.last.get(rank)
                if rec is None:
                    continue
            seq, since = self._seen.get(rank, (None, now))
            if rec["seq"] != seq:
                since = now
            self._seen[rank] = (rec["seq"], since)
            self.last[rank] = dict(rec, beat_age_s=now - since)
        return self.last

    def process_state(self, rank: int) -> str:
        """"alive" | "stopped" (SIGSTOP / a debugger: /proc says T) | "gone" | "unknown" (another host)."""
        ident = self.idents.get(rank, {})
        if ident.get("host") != socket.gethostname() or "pid" not in ident:
            return "unknown"
        try:
            with open(f"/proc/{ident['pid']}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            try:
                os.kill(ident["pid"], 0)
                return "alive"
            except OSError:
                return "gone"
        return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(state, "alive")


def states(handle: Any, ar: Any = None) -> dict[int, dict]:
    """rank -> {state, ...its record}: `ar` (a cell's AsyncResult) tells running from done; see the docstring."""
    monitor: Monitor = handle.monitor
    records = monitor.read() if monitor is not None else {}
    running = _running_ranks(handle, ar)
    dead = set(handle.dead_ranks())
    rollouts = getattr(handle, "rollout_ranks", [])   # outside the world (roles.py): no cell state of theirs
    out = {}
    for rank in handle.ranks + rollouts:
        rec = dict(records.get(rank) or {})
        process = monitor.process_state(rank) if monitor is not None else "unknown"
        if process == "gone" or (rank in dead and process == "unknown"):
            state = "dead"
        elif process == "stopped" or rank in dead or rec.get("beat_age_s", 0) >= monitor.stall_s:
            state = "frozen"
        elif rank in rollouts:
            state = "rollout"
        elif rank in running:
            state = "stuck" if _still(rec, monitor.stall_s) else "running"
        else:
            state = "done" if ar is not None else "idle"
        out[rank] = dict(rec, state=state, process=process)
    return out


def _running_ranks(handle: Any, ar: Any) -> set[int]:
    if ar is None:
        return set()
    targets = ar._targets if isinstance(ar._targets, list) else []
    return {handle.rank_of.get(e) for e, child in zip(targets, ar._children) if not child.done()}


def _still(rec: dict, stall_s: float) -> bool:
    """At one instruction for stall_s, and no progress report meanwhile."""
    progress_age = time.time() - (rec.get("progress") or {}).get("t", 0)
    return rec.get("still_s", 0) >= stall_s and progress_age >= stall_s


def stalled(by_rank: dict[int, dict]) -> bool:
    """A rank stuck or frozen while another has finished the cell (or died), or is stuck or frozen too."""
    held = [r for r, s in by_rank.items() if s["state"] in ("stuck", "frozen")]
    waiting = [r for r, s in by_rank.items() if s["state"] in ("done", "dead")]
    return bool(held) and (bool(waiting) or len(held) >= 2)


def describe(rank: int, s: dict) -> str:
    """One rank's state in words, e.g. 'rank 0: stuck in barrier for 31 s (no progress)'."""
    state = s["state"]
    if state == "stuck":
        where = f"in torch.distributed.{s['collective']}" if s.get("collective") else f"at {s.get('where')}"
        return f"rank {rank}: stuck {where} for {s.get('still_s', 0):.0f} s"
    if state == "frozen":
        why = ("its process is stopped (SIGSTOP or a debugger)" if s.get("process") == "stopped" else
               "its process is alive but silent (a C call holding the GIL?)")
        return f"rank {rank} (pid {s.get('pid')}): frozen, not dead: {why}; its last record is " \
               f"{s.get('beat_age_s', 0):.0f} s old"
    return f"rank {rank}: {state}"


def report(by_rank: dict[int, dict], *, stall_s: float) -> str:
    """The notebook's words for a stalled cell: every rank's state, each stuck or frozen rank's stack."""
    lines = [f"mfsdp_kit: this cell has stalled (no move for {stall_s:.0f} s on a rank while another waits):"]
    for rank, s in sorted(by_rank.items()):
        lines.append("  " + describe(rank, s))
        if s["state"] in ("stuck", "frozen") and s.get("stack"):
            lines += [f"    {line}" for frame in s["stack"] for line in frame.splitlines()]
    lines.append("Nothing is aborted. Press Stop twice (or run handle.abort() once the kernel is free) to abort the "
                 "world: every rank's cell returns, the engines and their variables live on, and handle.reinit() "
                 "builds a new world.")
    return "\n".join(lines)
