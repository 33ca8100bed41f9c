"""A failure on one rank is never a hang: the client aborts the world's process groups on every rank.

The hang: rank 1 raises, rank 0 has entered an all-reduce and waits for rank 1 until the collective's
timeout (10 minutes by default). SIGINT does not help (a Python handler never runs while the main thread
sits in a C++ collective), and gloo's `ProcessGroup.abort()` on the *stuck* rank does not wake its own
pending collective. What does: every rank aborting its process groups. For gloo the ranks that are not
stuck (the one that raised) close their sockets, so the stuck peers' collectives fail at once with
"Connection closed by peer"; for NCCL `ncclCommAbort` wakes the stuck rank itself.

Who decides: the notebook. Every AsyncResult of `handle.view.execute` / `apply_async` (what `%%px`,
`handle.run`, `handle.apply` and `run_with_progress` submit) gets a guard thread on the client. When one
rank's result is an error (or its engine died) while other ranks are still running `grace_s` later, the
guard sets a key in the world's rendezvous store (torch's TCPStore on rank 0). Each engine runs a watchdog
thread that blocks on that key (its own store connection, GIL released) and calls
`torch.distributed.distributed_c10d._abort_process_group()` when it appears. Every rank's cell returns;
the process groups are gone, the engines (and their namespaces) live on: `handle.reinit()` builds a new
world on the same engines. A cell that fails on every rank (a typo) aborts nothing.
"""
from __future__ import annotations

import re
import sys
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

from . import launch, stall

GRACE_S = 1.0
"""How long the other ranks may keep running after one rank failed before the world is aborted."""
aborted: str | None = None
"""Engine side: why this engine's world was aborted (None while it was not)."""


# ---- engine side -----------------------------------------------------------------------------------
def arm(addr: str, port: int, key: str) -> None:
    """Start this engine's watchdog for the world whose abort key is `key` (runs after runtime.init)."""
    global aborted
    aborted = None
    threading.Thread(target=_watch, args=(addr, port, key), name="mfsdp_kit-watchdog", daemon=True).start()


def _watch(addr: str, port: int, key: str) -> None:
    global aborted
    import torch.distributed as dist
    try:
        store = dist.TCPStore(addr, port, None, False, timeout=timedelta(days=365), wait_for_workers=False)
        store.wait([key])
        reason = store.get(key).decode()
    except Exception:  # noqa: BLE001 -- the store went away (rank 0 died or the world was rebuilt)
        return
    aborted = reason
    if dist.is_initialized():
        dist.distributed_c10d._abort_process_group()


# ---- client side -----------------------------------------------------------------------------------
def new_key() -> str:
    return f"mfsdp_kit/abort/{uuid.uuid4().hex}"


def abort_world(handle: Any, reason: str) -> None:
    """Tell every engine's watchdog to abort the world's process groups (idempotent)."""
    import torch.distributed as dist
    if handle.abort_reason is not None:
        return
    handle.abort_reason = reason
    try:
        store = dist.TCPStore(handle.init_kwargs["master_addr"], handle.master_port, None, False,
                              timeout=timedelta(seconds=5), wait_for_workers=False)
        store.set(handle.world_key, reason)
    except Exception:  # noqa: BLE001 -- rank 0 (the store) is dead: gloo peers fail on their own
        pass


def failed_and_pending(handle: Any, ar: Any) -> tuple[list[str], int]:
    """(what failed, e.g. 'rank 1 raised NameError: ...' or 'rank 1 died', how many ranks still run)."""
    rank_of = handle.rank_of
    failed, pending = [], 0
    dead = set(handle.dead_ranks())
    targets = ar._targets if isinstance(ar._targets, list) and len(ar._targets) == len(ar.msg_ids) else []
    for i, child in enumerate(ar._children):   # one future per engine, in target order
        rank = rank_of.get(targets[i] if targets else None, "?")
        if not child.done():
            pending += 1
            if rank in dead:
                failed.append(f"rank {rank} died")
            continue
        result = child.exception() or child.result()
        if isinstance(result, Exception):
            failed.append(f"rank {rank} raised {getattr(result, 'ename', type(result).__name__)}: "
                          f"{getattr(result, 'evalue', result)}")
    failed += [f"rank {r} died" for r in dead if f"rank {r} died" not in failed]
    return failed, pending


def guard(handle: Any, ar: Any, *, grace_s: float | None = None, poll_s: float = 0.1) -> Any:
    """Watch `ar` from a daemon thread: abort the world when a rank failed and others still run; name a stalled
    cell once (`stall.py`); abort the world when the cell runs past `handle.cell_timeout_s` (opt-in)."""
    grace_s = GRACE_S if grace_s is None else grace_s
    started, handle.inflight = time.monotonic(), [a for a in handle.inflight if not a.ready()] + [ar]

    def watch() -> None:
        since, checked, told = None, started, False
        while not ar.ready() and handle.abort_reason is None and handle.view is not None:
            if lost := launch.controller_error(handle.cluster):   # no reply can come: fail the cell (%%px) now
                _fail(ar, lost)
                return
            failed, pending = failed_and_pending(handle, ar)
            failed = [f for f in failed if "raised KeyboardInterrupt" not in f]   # Stop: interrupt.pause's to handle
            if failed and pending:
                since = since or time.monotonic()
                if time.monotonic() - since >= grace_s:
                    abort_world(handle, "; ".join(failed))
                    return
            timeout_s = handle.cell_timeout_s
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                abort_world(handle, f"the cell ran past timeout_s={timeout_s} s")
                return
            if not told and handle.monitor is not None and time.monotonic() - checked >= 1.0:
                checked = time.monotonic()
                if stall.stalled(by_rank := stall.states(handle, ar)):
                    print(stall.report(by_rank, stall_s=handle.monitor.stall_s), file=sys.stderr, flush=True)
                    told = True
            time.sleep(poll_s)

    threading.Thread(target=watch, name="mfsdp_kit-guard", daemon=True).start()
    return ar


def check_not_stuck(handle: Any) -> None:
    """Raise ClusterError at once when an engine is gone (ipyparallel's own answer is a bare KeyError) or a cell
    still running on some rank is stalled: a new cell would queue behind it and hang without a word."""
    if dead := handle.dead_ranks():
        raise handle._died(dead, when="earlier")
    for ar in [a for a in handle.inflight if not a.ready()]:
        if handle.monitor is not None and stall.stalled(by_rank := stall.states(handle, ar)):
            raise launch.ClusterError("an earlier cell is still running and the world is stuck, so this cell would "
                                      "wait behind it forever; nothing was sent.\n"
                                      + stall.report(by_rank, stall_s=handle.monitor.stall_s))


def _fail(ar: Any, error: Exception) -> None:
    """Resolve `ar` with `error`: its `get()` (and a %%px cell waiting on it) raises it at once."""
    try:
        ar.set_exception(error)
    except Exception:  # noqa: BLE001 -- the reply came meanwhile (InvalidStateError)
        pass


def guard_view(handle: Any) -> None:
    """Guard everything submitted through `handle.view.execute` / `apply_async` (`%%px` uses execute)."""
    view = handle.view
    execute, apply_async = view.execute, view.apply_async

    def guarded_execute(code: str, *args: Any, **kwargs: Any) -> Any:
        check_not_stuck(handle)
        block = kwargs.pop("block", None)
        block = view.block if block is None else block
        ar = guard(handle, execute(code, *args, block=False, **kwargs))
        return ar.get() if block else ar

    view.execute = guarded_execute
    def guarded_apply(fn: Any, *args: Any, **kwargs: Any) -> Any:
        check_not_stuck(handle)
        return guard(handle, apply_async(fn, *args, **kwargs))
    view.apply_async = guarded_apply


def describe(handle: Any, err: Exception) -> str:
    """A CompositeError from the engines, tagged by rank, the first failure first, with its traceback."""
    elist = getattr(err, "elist", None) or []
    lines = [f"world aborted: {handle.abort_reason}" if handle.abort_reason else "the cell failed:"]
    for ename, evalue, tb, info in elist:
        rank = handle.rank_of.get((info or {}).get("engine_id"), "?")
        lines.append(f"--- rank {rank}: {ename}: {evalue}")
        if tb and f"rank {rank} raised" in (handle.abort_reason or f"rank {rank} raised"):
            lines.append(re.sub(r"\x1b\[[0-9;]*m", "", tb if isinstance(tb, str) else "\n".join(tb)))
    if handle.abort_reason:
        lines.append("The process groups are aborted on every rank (the engines and their variables live on): "
                     "run handle.reinit() to build a new world, then rebuild models and optimizers.")
    return "\n".join(lines)


def footer(handle: Any, err: Exception) -> str | None:
    """The line printed under a failed `%%px` cell's traceback: the dead rank, or the rank-tagged abort."""
    if dead := handle.dead_ranks():
        return str(handle._died(dead))
    if handle.abort_reason:
        return describe(handle, getattr(err, "original_error", err))
    return None


class PxCellError(Exception):
    """A `%%px` cell failed: its traceback is every failed rank's remote traceback, tagged by rank (`describe`)."""

    def __init__(self, text: str):
        super().__init__(text.splitlines()[1] if text.count("\n") else text)   # the first rank's "rank r: X: msg"
        self.text = text

    def _render_traceback_(self) -> list[str]:   # IPython shows these lines in place of a local traceback
        return self.text.splitlines()


def px_exception_handler(handle: Any):
    """The IPython handler `cluster.start` installs for engine errors (`shell.set_custom_exc`).

    ipyparallel streams each engine's traceback to the cell's stderr as it arrives, then raises
    `AlreadyDisplayedError`, whose own traceback is only "1 errors". The cell's error is what nbval, nbconvert
    and papermill report (nbval prints no stream output), so a failing notebook's log named no exception and no
    line (issue 50). Here the error carries them: every rank's traceback, tagged by rank, the world's abort
    first. In JupyterLab the tracebacks thus show twice, streamed and in the error. A dead engine keeps
    ipyparallel's error and gets `footer`'s line under it."""

    def explain(shell, etype, value, tb, tb_offset=None):
        composite = getattr(value, "original_error", value)
        if getattr(composite, "elist", None) and not handle.dead_ranks():
            error = PxCellError(describe(handle, composite))
            shell.showtraceback((PxCellError, error, tb))
            return
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        if line := footer(handle, value):
            print(f"ClusterError: {line}")
    return explain
