"""Every thread's stack of an engine that does not answer while the world forms, read from this machine.

Before `runtime.init` an engine has no heartbeat (heartbeat.py) to say where it is: a step of `cluster.start` that
waits past its `timeout_s` could only say "no answer". The kit's engine (`ipengine.main`) therefore arms
`faulthandler` on SIGUSR1 at boot, writing into a file named for the cluster and its pid in the profile's log
folder; on such a timeout the kernel signals every local engine whose file is there and puts the stacks in the
error (`describe`). Remote engines' files stay on their hosts, and are not read.
"""
from __future__ import annotations

import faulthandler
import os
import re
import signal
import time
from pathlib import Path

SIGNAL = signal.SIGUSR1
"""What makes an armed engine write its stacks (faulthandler: from C code too, without the GIL)."""
WAIT_S = 1.0
"""Seconds the kernel waits for the signalled engines to write."""
MAX_LINES = 25
"""Lines kept of each engine's main thread (faulthandler writes it last, its innermost frame first): where it
handles requests, so where a step that gets no answer is stuck."""
_file = None   # the armed engine's open file: faulthandler writes to its descriptor


def folder(profile_dir: str) -> Path:
    return Path(profile_dir) / "log"


def arm(*, profile_dir: str | None, cluster_id: str) -> Path | None:
    """In an engine: write every thread's stack into `<profile_dir>/log/mfsdp_kit-stacks-<cluster>-<pid>.txt` on
    SIGUSR1. None (nothing armed) without a profile folder or where the signal is not available."""
    global _file
    if not profile_dir or not hasattr(signal, "SIGUSR1"):
        return None
    path = folder(profile_dir) / f"mfsdp_kit-stacks-{cluster_id}-{os.getpid()}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    _file = open(path, "w")   # noqa: SIM115 -- kept open for the process's life
    faulthandler.register(SIGNAL, file=_file, all_threads=True)
    return path


def _files(profile_dir: str, cluster_id: str) -> dict[int, Path]:
    prefix = f"mfsdp_kit-stacks-{cluster_id}-"
    found = folder(profile_dir).glob(f"{prefix}*.txt") if folder(profile_dir).is_dir() else []
    return {int(p.stem[len(prefix):]): p for p in found if p.stem[len(prefix):].isdigit()}


def describe(*, profile_dir: str, cluster_id: str, wait_s: float = WAIT_S) -> str:
    """The stacks of this cluster's live local engines, each headed by its pid ("" when none is armed here)."""
    signalled = {}
    for pid, path in _files(profile_dir, cluster_id).items():
        try:
            os.kill(pid, SIGNAL)
            signalled[pid] = path
        except (ProcessLookupError, PermissionError):   # an engine of an earlier start, gone
            path.unlink(missing_ok=True)
    if not signalled:
        return ""
    time.sleep(wait_s)
    return "\n".join(f"engine pid {pid}, main thread:\n  " + "\n  ".join(main_thread(path.read_text(errors="replace")))
                     for pid, path in sorted(signalled.items()))


def main_thread(dump: str) -> list[str]:
    """The first `MAX_LINES` lines of the last thread of faulthandler's last dump in `dump` (the main thread)."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip())
    return blocks[-1].splitlines()[:MAX_LINES] if dump.strip() else ["(wrote nothing: stuck outside Python?)"]


def remove(*, profile_dir: str, cluster_id: str) -> None:
    """Delete this cluster's stack files (its engines are stopped)."""
    for path in _files(profile_dir, cluster_id).values():
        path.unlink(missing_ok=True)
