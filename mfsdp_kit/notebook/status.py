"""`handle.status()`: every rank of the world at a glance, and a widget that refreshes it while a long cell runs.

One row per rank: its state (`stall.states`: running, done, idle, stuck, frozen, dead), the step and total of its
last `report`, seconds since that report, tokens/s, memory (the GPU's allocated bytes, or the process's RSS on the
CPU), where its main thread is (or the collective it waits in) and its log file. Read from the heartbeat records in
the world's store, so it answers while every engine is busy; in a notebook the kernel itself is busy while a
`%%px` cell runs, so `handle.status_widget()` shows the same table in a widget that a thread refreshes, and a cell
run with `%%px --noblock` leaves the kernel free to ask `handle.status()`.
"""
from __future__ import annotations

import html
import os
import threading
import time
from typing import Any

COLUMNS = ("rank", "state", "step", "since progress", "tokens/s", "memory", "where", "log")


def _memory(s: dict) -> str:
    if s.get("memory_bytes") is None:
        return "-"
    return f"{s['memory_bytes'] / 2**30:.2f} GiB {'GPU' if s.get('memory_kind') == 'gpu' else 'RSS'}"


def row(rank: int, s: dict) -> tuple[str, ...]:
    """One rank's cells, as text."""
    progress = s.get("progress") or {}
    step = f"{progress['step']}/{progress.get('total') or '?'}" if "step" in progress else "-"
    since = f"{time.time() - progress['t']:.0f} s" if "t" in progress else "-"
    rate = f"{progress['tokens_per_s']:,.0f}" if isinstance(progress.get("tokens_per_s"), (int, float)) else "-"
    state = s["state"] + (f" ({s['still_s']:.0f} s)" if s["state"] == "stuck" else "")
    where = f"in {s['collective']}" if s.get("collective") else os.path.basename(s.get("where") or "-")
    return (str(rank), state, step, since, rate, _memory(s), where, s.get("log") or "-")


class Status:
    """The table `handle.status()` returns: text in a terminal, HTML in a notebook; `.ranks` holds the raw records."""

    def __init__(self, by_rank: dict[int, dict], *, stall_s: float):
        self.ranks, self.stall_s = by_rank, stall_s

    def rows(self) -> list[tuple[str, ...]]:
        return [row(r, s) for r, s in sorted(self.ranks.items())]

    def __str__(self) -> str:
        rows = [COLUMNS, *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{c}</th>" for c in COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in self.rows())
        return f"<table><tr>{head}</tr>{body}</table>"


def widget(handle: Any, *, period_s: float = 1.0):
    """An ipywidgets HTML showing `handle.status()`, refreshed every `period_s` by a daemon thread until the handle
    stops (display it in a cell before the long one: it keeps refreshing while that cell runs)."""
    import ipywidgets as w
    out = w.HTML(handle.status()._repr_html_())

    def refresh() -> None:
        while handle.view is not None:
            time.sleep(period_s)
            try:
                out.value = handle.status()._repr_html_()
            except Exception as err:  # noqa: BLE001 -- the world is being rebuilt: show why, try again
                out.value = f"<pre>{html.escape(str(err))}</pre>"
    threading.Thread(target=refresh, name="mfsdp_kit-status", daemon=True).start()
    return out
