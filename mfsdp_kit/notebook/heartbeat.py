"""Engine side of a cell's status: what each rank is doing, published once a second, and its output in a log file.

A notebook cannot ask a busy engine anything: its requests queue behind the running cell, and a rank that waits
in a collective runs no Python in its main thread. So each engine runs a thread (`start`) that publishes, every
`PERIOD_S`, a small JSON record to the world's store (torch's TCPStore on rank 0, the one the watchdog uses):
- the last `distributed.progress.report` (step, total, tokens/s, ...) and when it came (published at once);
- where the main thread is (`sys._current_frames`: readable while it sits in C++, which releases the GIL), for how
  long it has stood at that very instruction, the torch.distributed collective it is in, if any, and its stack;
- memory: the GPU's allocated and peak bytes, or the process's RSS on the CPU.
The client (`notebook/stall.py`) reads the records: `handle.status()`, and naming stuck and frozen ranks. A rank
whose record stops changing is frozen (SIGSTOP, a debugger, a C call holding the GIL): its last record, stack
included, is what the notebook shows.

Each engine's stdout and stderr also go to `<log_dir>/rank<r>.log` (ipykernel's `OutStream.echo`), so a long cell's
output outlives the cell and can be read from a terminal (`tail -f`).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

PERIOD_S = 1.0
"""Seconds between two records of one rank."""
MIN_GAP_S = 0.1
"""Fewest seconds between two records: a loop that reports every millisecond costs the store 10 writes a second."""
STACK_FRAMES = 12
"""Innermost frames of the main thread kept in a record."""
_stop_event: threading.Event | None = None


def key(prefix: str, rank: int) -> str:
    return f"{prefix}/{rank}"


def start(*, addr: str, port: int, prefix: str, rank: int, log_dir: str | None) -> str | None:
    """Publish this rank's record under `key(prefix, rank)` every PERIOD_S (a daemon thread, replacing the previous
    world's) and tee its output to `<log_dir>/rank<rank>.log`. Returns the log file's path (None without log_dir)."""
    global _stop_event
    import torch.distributed as dist
    if _stop_event is not None:
        _stop_event.set()
    log = _tee_output(Path(log_dir) / f"rank{rank}.log") if log_dir else None
    store = dist.TCPStore(addr, port, None, False, timeout=timedelta(seconds=30), wait_for_workers=False)
    _stop_event = stop_event = threading.Event()
    main = threading.main_thread().ident
    mark = dict(frame=None, since=time.time())
    publish = lambda seq: store.set(key(prefix, rank), json.dumps(record(rank, main, mark, log, seq=seq), default=str))
    publish(0)   # the key exists from here on

    def beat() -> None:
        from ..distributed import progress
        seq = 0
        while not stop_event.is_set():
            progress.reported.wait(PERIOD_S)   # a beat, or a `report` to pass on at once
            progress.reported.clear()
            if stop_event.is_set():
                return
            seq += 1
            try:
                publish(seq)
            except Exception:  # noqa: BLE001 -- the store is gone (rank 0 died, the world was rebuilt)
                return
            stop_event.wait(MIN_GAP_S)
    threading.Thread(target=beat, name="mfsdp_kit-heartbeat", daemon=True).start()
    return log


def record(rank: int, main: int, mark: dict, log: str | None, *, seq: int) -> dict:
    """This rank's record now; `mark` remembers the main thread's instruction and since when it stands there."""
    from ..distributed import progress
    frame = sys._current_frames().get(main)
    here = None if frame is None else (id(frame.f_code), frame.f_lasti, id(frame))
    now = time.time()
    if here != mark["frame"]:
        mark.update(frame=here, since=now)
    return dict(seq=seq, t=now, rank=rank, pid=os.getpid(), progress=progress.latest, still_s=now - mark["since"],
                collective=collective_of(frame), where=_where(frame), stack=stack_of(frame), log=log, **memory())


def collective_of(frame) -> str | None:
    """The torch.distributed function the main thread is in (e.g. "barrier", "all_reduce"), else None."""
    name = None
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("torch", "distributed", "distributed_c10d.py")) \
                and frame.f_code.co_name != "wrapper":
            name = frame.f_code.co_name   # the outermost one: barrier, not the helpers it calls
        frame = frame.f_back
    return name


def _where(frame) -> str:
    return "" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


HOST_FRAMES = tuple(os.sep + name + os.sep for name in ("ipykernel", "IPython", "ipyparallel", "asyncio", "tornado"))
"""Frames of the engine's own machinery (the kernel running the cell), left out of a published stack."""


def stack_of(frame) -> list[str]:
    """The main thread's innermost STACK_FRAMES frames below the kernel's own, outermost first, as traceback prints
    them: the cell's line, the kit's, torch's."""
    import traceback
    frames = traceback.extract_stack(frame, limit=4 * STACK_FRAMES) if frame is not None else []
    frames = [f for f in frames if not any(part in f.filename for part in HOST_FRAMES)][-STACK_FRAMES:]
    return [f'File "{f.filename}", line {f.lineno}, in {f.name}' + (f"\n    {f.line}" if f.line else "")
            for f in frames]


def memory() -> dict:
    """The device's allocated and peak bytes on a GPU rank, else the process's resident bytes."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return dict(memory_bytes=torch.cuda.memory_allocated(), peak_bytes=torch.cuda.max_memory_allocated(),
                    memory_kind="gpu")
    import psutil
    return dict(memory_bytes=psutil.Process().memory_info().rss, peak_bytes=None, memory_kind="rss")


class _Tee:
    """A file-like that writes to a log file and to what `OutStream.echo` held before."""

    def __init__(self, file, previous):
        self.file, self.previous = file, previous

    def write(self, text: str) -> int:
        self.file.write(text)
        if self.previous is not None:
            self.previous.write(text)
        return len(text)

    def flush(self) -> None:
        self.file.flush()
        if self.previous is not None:
            self.previous.flush()


def _tee_output(path: Path) -> str:
    """stdout and stderr (ipykernel's OutStreams) also into `path`, line-buffered; a later call moves them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    file = open(path, "a", buffering=1, encoding="utf-8")   # noqa: SIM115 -- open for the engine's life
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "echo"):   # ipykernel's OutStream; a plain stream (tests, scripts) is left alone
            previous = stream.echo.previous if isinstance(stream.echo, _Tee) else stream.echo
            stream.echo = _Tee(file, previous)
    return str(path)
