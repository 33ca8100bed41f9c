"""`python -m mfsdp_kit.ipengine`: ipyparallel's own engine, with torch and megatron imported meanwhile.

Most of `cluster.start` is every engine importing torch and megatron.core (bench/cluster_start.py: the
import floor). The naive order -- boot the engine, register, wait for the others, then import in
`runtime.init` -- leaves those imports idle while the engine waits for its nanny process, the controller
and the slowest peer. Here a background thread imports them from the engine's first instant; the
engine itself is unchanged (`ipyparallel.engine.app.main`, same arguments), and `cluster._engine_init`
calls `wait()` before it imports anything, so no module is imported by two threads at once.

The default engine command where the machine has 4+ cores per engine (`launch.preload_by_default`): the
thread shares the engine's GIL with its boot, so it only pays where cores are free; bench/cluster_start.py
measures it next to ipyparallel's plain engine.
"""
from __future__ import annotations

import importlib
import threading

MODULES = ("torch", "torch.distributed", "megatron.core.parallel_state", "mfsdp_kit.runtime")
"""What `runtime.init` imports first, heaviest first."""
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
        _thread = threading.Thread(target=_import_all, name="mfsdp_kit-preload", daemon=True)
        _thread.start()


def wait() -> None:
    """Block until the imports are done; a no-op in an engine not started by this module."""
    if _thread is not None:
        _thread.join()
        if _error is not None:
            raise _error


def main() -> None:
    start()
    from ipyparallel.engine.app import main as engine_main
    engine_main()


if __name__ == "__main__":
    from mfsdp_kit import ipengine   # the importable module, whose thread `wait()` joins (not __main__'s)
    ipengine.main()
