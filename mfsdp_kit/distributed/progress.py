"""A loop's progress, passed on to whoever listens: the training side of `cluster.report` (beside `stop`, the other
thing a loop on a notebook engine hears from or tells the notebook).

`train.fit` and the RL loops call `report(step=, total=, **metrics)` after each step. Training code does not know
where that goes: a notebook engine listens (`notebook/on_engine.py` installs `notebook.progress.publish`, which
sends it to the notebook's progress bars and panels), and the engine's heartbeat reads `latest` for
`handle.status()`. Under torchrun or in a script nobody listens and a report costs a dict. The naive version -- the
loop importing the notebook side to publish -- made the bottom of the kit depend on its top (issue 70).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

latest: dict | None = None
"""This process's last `report`, with `t`, when it came (time.time())."""
reported = threading.Event()
"""Set by each `report`, so a listener thread (the heartbeat) can pass it on at once rather than at its next beat."""
_listeners: list[Callable[[dict], None]] = []


def report(*, step: int, total: int | None = None, **metrics: Any) -> None:
    """This rank's progress after a step (step counts from 1); each listener gets {step, total, **metrics}."""
    global latest
    latest = dict(step=step, total=total, t=time.time(), **metrics)
    reported.set()
    for listener in _listeners:
        listener(dict(step=step, total=total, **metrics))


def listen(listener: Callable[[dict], None]) -> None:
    """Call `listener(data)` on every later `report` in this process (once, however often it is added)."""
    if listener not in _listeners:
        _listeners.append(listener)


def unlisten(listener: Callable[[dict], None]) -> None:
    """Stop calling `listener` (a no-op when it was not listening)."""
    if listener in _listeners:
        _listeners.remove(listener)
