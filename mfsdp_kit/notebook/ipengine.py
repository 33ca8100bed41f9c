"""`python -m mfsdp_kit.notebook.ipengine`: ipyparallel's own engine, started before the controller is up, with torch and
megatron imported meanwhile.

Most of `cluster.start` is every engine booting and importing torch and megatron.core (bench/cluster_start.py:
the import floor). The naive order -- start the controller, wait for its connection file, spawn the engines,
let them register, then import in `runtime.init` -- leaves each step idle while the one before it runs. This
engine removes two of those waits:

- it can be spawned before the controller (`launch.start_processes` does so for local engines): it boots and
  imports ipyparallel while the controller boots, then waits for the controller's connection file itself
  (`wait_for_connection_info`, reading it only once it is whole JSON: the controller creates it empty, then
  writes it, and ipyparallel's engine would read whatever is there). Started after the controller (restart,
  MPI), it finds `$IPP_CONNECTION_INFO` set and goes straight on;
- unless `MFSDP_KIT_PRELOAD=0`, a background thread imports torch and
  megatron.core from the engine's first instant, so the imports overlap the engine's waits (the controller,
  its nanny process, registration, the slowest peer); `cluster._engine_init` calls `wait()` before it imports
  anything, so no module is imported by two threads at once.

It also exits when the process that spawned it is gone (`watch_parent`): a notebook kernel killed mid-cell
(restarted by the user, or by nbval) used to leave its engines running, holding their GPUs, whenever one sat in a
collective, because ipyparallel's own check (the controller's heartbeat) runs on the event loop that the cell blocks.

The engine itself is unchanged (`ipyparallel.engine.app.main`, same arguments).
"""
from __future__ import annotations

import importlib
import json
import os
import threading
import time
from typing import Callable

from . import stacks

MODULES = ("torch", "torch.distributed", "megatron.core.parallel_state", "mfsdp_kit.distributed.runtime")
"""What `runtime.init` imports first, heaviest first."""
PRELOAD_ENV = "MFSDP_KIT_PRELOAD"
"""'0': no import thread (the imports then run in `runtime.init`); anything else or unset: imports at boot."""
WAIT_ENV = "MFSDP_KIT_CONNECTION_WAIT_S"
"""Seconds an engine spawned before the controller waits for its connection file (launch.py sets `timeout_s`)."""
PARENT_ENV = "MFSDP_KIT_PARENT_PID"
"""The pid of the process that launches the kit's local engines and controller (`launch.make_cluster` sets it)."""
ORPHANED_EXIT = 75
"""The exit code of an engine whose launcher died (`watch_parent`)."""
_thread: threading.Thread | None = None
_error: BaseException | None = None


def _import_all() -> None:
    global _error
    try:
        for name in MODULES:
            importlib.import_module(name)
    except BaseException as err:  # noqa: BLE001 -- re-raised by wait(), in the engine's main thread
        _error = err


def start() -> None:
    """Begin the imports in a daemon thread (once per process)."""
    global _thread
    if _thread is None:
        from .. import compat
        compat.apply("startup")   # before the thread imports megatron (compat/patches/startup.py)
        _thread = threading.Thread(target=_import_all, name="mfsdp_kit-preload", daemon=True)
        _thread.start()


def wait() -> None:
    """Block until the imports are done; a no-op in an engine not started by this module."""
    if _thread is not None:
        _thread.join()
        if _error is not None:
            raise _error


def connection_file(profile_dir: str, cluster_id: str) -> str:
    """Where ipyparallel's controller writes the engines' connection info (its launchers' `connection_files`)."""
    prefix = f"ipcontroller-{cluster_id}" if cluster_id else "ipcontroller"
    return os.path.join(profile_dir, "security", f"{prefix}-engine.json")


def wait_for_connection_info(path: str, timeout_s: float, poll_s: float = 0.02) -> dict:
    """The controller's engine connection info, once `path` holds whole JSON with the signing key."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(path) as f:
                info = json.load(f)
            if isinstance(info, dict) and "key" in info and "registration" in info:
                return info
        except (OSError, ValueError):   # not there yet, or created but not yet written
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the controller's connection file {path} did not arrive within {timeout_s} s")
        time.sleep(poll_s)


def _exit_now() -> None:
    os._exit(ORPHANED_EXIT)   # from C++ collectives too: no Python unwinding to wait for


def watch_parent(*, poll_s: float = 1.0, on_orphan: Callable[[], None] = _exit_now) -> threading.Thread:
    """A daemon thread that calls `on_orphan` (default: `os._exit(ORPHANED_EXIT)`) once this process's parent is
    not its launcher: the launcher (the kernel for local engines and the controller, mpiexec for MPI engines) has
    died and this process was re-parented. The launcher is `$MFSDP_KIT_PARENT_PID` where the kit set it (local
    engines and controller), so a kernel that died before this thread started is noticed too; else the parent now."""
    parent = int(os.environ.get(PARENT_ENV) or os.getppid())

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        on_orphan()
    thread = threading.Thread(target=watch, name="mfsdp_kit-parent-watch", daemon=True)
    thread.start()
    return thread


def main() -> None:
    watch_parent()
    stacks.arm(profile_dir=os.environ.get("IPP_PROFILE_DIR"), cluster_id=os.environ.get("IPP_CLUSTER_ID", ""))
    if os.environ.get(PRELOAD_ENV, "1") != "0":
        start()
    from ipyparallel.engine.app import main as engine_main   # the engine's own imports, while the controller boots
    profile_dir, cluster_id = os.environ.get("IPP_PROFILE_DIR"), os.environ.get("IPP_CLUSTER_ID", "")
    if "IPP_CONNECTION_INFO" not in os.environ and profile_dir:   # spawned before the controller
        info = wait_for_connection_info(connection_file(profile_dir, cluster_id),
                                        float(os.environ.get(WAIT_ENV, "120")))
        os.environ["IPP_CONNECTION_INFO"] = json.dumps(info)
    engine_main()


if __name__ == "__main__":
    from mfsdp_kit.notebook import ipengine   # the importable module, whose thread `wait()` joins (not __main__'s)
    ipengine.main()
