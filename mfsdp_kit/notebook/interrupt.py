"""Client side of Stop: what the notebook does when the user presses Stop (a kernel interrupt) while engines run a cell.

ipyparallel's own answer: `%%px` catches the KeyboardInterrupt, sends SIGINT to the engines and returns at once,
"ok". Each engine then raises KeyboardInterrupt wherever it is; on several ranks that breaks the world (issue 69:
9 Stops in 11 left an engine stuck in a collective or a model that failed on its next step), and the cell said
nothing of it.

The kit's answer (`pause`), for `%%px`, `handle.run` / `apply` and `run_with_progress` alike:
1. SIGINT every rank. In a kit loop (`train.fit`, the RL loops) that only raises a flag
   (`distributed.stop`): every rank leaves at the same step boundary, with the state between two steps. In any other
   code it is Python's KeyboardInterrupt, on every rank.
2. Wait for the cell to end on every rank, then print one line: "train.fit: stopped at step N of M on every rank
   (History kept ...)". A pause that takes over a second says first what it waits for; a rank that cannot get
   there (it waits in a collective its peer left) is named by the stall monitor (`stall.py`) while this waits.
3. A second Stop while it waits escalates: the world's process groups are aborted on every rank (`watchdog`:
   that wakes a rank stuck in a collective), SIGINT again, and the cell says so; the engines and their variables
   live on and `handle.reinit()` builds a new world.
"""
from __future__ import annotations

import sys
import time
from typing import Any

import ipyparallel as ipp

from . import watchdog

SLOW_PAUSE_S = 1.0
"""A pause still waiting after this long says what it waits for, and that Stop again aborts the world."""
ESCALATED_WAIT_S = 10.0
"""How long the cell waits for the ranks after the world was aborted (aborted collectives return at once)."""


def signal_ranks(handle: Any) -> None:
    """SIGINT to every engine of the world and to its rollout engines (roles.py: their loop stops too, and closes
    the link), through ipyparallel's nannies: works while an engine is busy."""
    handle.client.send_signal("SIGINT", targets=sorted(handle.rank_of) + list(handle.rollout_ids), block=True)


def pause(handle: Any, ar: Any) -> list | None:
    """Stop pressed while `ar` runs: the protocol of the module docstring. Returns the results in rank order when
    every rank ended (None after an escalation); raises what the cell raised otherwise."""
    from ..distributed import stop
    started, told = time.monotonic(), []
    signal_ranks(handle)

    def tell_if_slow(_ar: Any) -> None:   # a pause that ends at once is the one line below; a slow one says why
        if not told and time.monotonic() - started > SLOW_PAUSE_S:
            told.append(True)
            print("Stop: every rank finishes its current step and leaves at the same step boundary "
                  "(press Stop again to abort the world instead)", flush=True)
    try:
        results = handle.wait(ar, pause_on_stop=False, on_poll=tell_if_slow)
    except KeyboardInterrupt:
        escalate(handle, ar)
        return None
    except ipp.error.CompositeError as err:
        if not all(e[0] == "KeyboardInterrupt" for e in err.elist):
            raise
        handle.apply(stop.take, pause_on_stop=False)
        why = sorted({str(e[1]) for e in err.elist if e[1]}) or ["the cell was not in a kit loop, so Python's own "
                                                                 "interrupt ended it"]
        print(f"KeyboardInterrupt on every rank ({time.monotonic() - started:.1f} s after Stop): {'; '.join(why)}",
              file=sys.stderr)
        raise KeyboardInterrupt from None
    taken = handle.apply(stop.take, pause_on_stop=False)
    _finish_px_bars(ar)
    print(summary(taken, seconds=time.monotonic() - started), flush=True)
    return results


def _finish_px_bars(ar: Any) -> None:
    """Bring ipyparallel's "%px" progress bar to its end: the KeyboardInterrupt left it where Stop found it (0/2
    tasks), which reads as a cell that never finished."""
    from tqdm.auto import tqdm
    for bar in [b for b in list(getattr(tqdm, "_instances", ())) if b.desc == getattr(ar, "_fname", None)]:
        bar.update(bar.total - bar.n)
        bar.close()


def summary(taken: list[dict | None], *, seconds: float) -> str:
    """The one line after a Stop: where every rank stopped (`stop.take`'s records, in rank order)."""
    from ..distributed.stop import Stopped
    if all(t is None for t in taken):
        return f"Stop came as the cell ended: it finished on every rank ({seconds:.1f} s)"
    if all(t == taken[0] for t in taken):
        return f"{Stopped(**taken[0]).line()} ({seconds:.1f} s after Stop)"
    return "ranks stopped at different places: " + "; ".join(f"rank {r}: {t}" for r, t in enumerate(taken))


def escalate(handle: Any, ar: Any) -> None:
    """The second Stop: abort the world's process groups on every rank, interrupt every rank again, say so."""
    watchdog.abort_world(handle, "Stop pressed twice")
    signal_ranks(handle)
    ar.wait(ESCALATED_WAIT_S)
    running = [] if ar.ready() else sorted(set(handle.ranks) - set(handle.dead_ranks()))
    still = f"; ranks {running} still run (handle.restart() replaces the engines)" if running else ""
    print("Stop pressed twice: the world's process groups are aborted on every rank (the engines and their variables "
          f"live on{still}). Run handle.reinit() to build a new world, then rebuild models and optimizers.",
          file=sys.stderr, flush=True)


def activate(handle: Any) -> None:
    """Register %px / %%px on the rank-ordered view, with this module's Stop (and `watchdog.px_exception_handler`
    for a failed cell's error)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    handle.view.activate()
    shell.set_custom_exc((ipp.error.RemoteError, ipp.error.EngineError), watchdog.px_exception_handler(handle))
    magics = shell.magics_manager.registry.get("ParallelMagics")
    if magics is None or getattr(magics, "view", None) is not handle.view:
        return
    magics.signal_on_interrupt = None   # ipyparallel then re-raises the KeyboardInterrupt: `pause` handles it
    execute = magics.parallel_execute

    def parallel_execute(cell: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return execute(cell, *args, **kwargs)
        except KeyboardInterrupt:
            pause(handle, magics.last_result)
    magics.parallel_execute = parallel_execute
