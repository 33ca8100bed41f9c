"""`python -m mfsdp_kit.notebook.ipcontroller`: ipyparallel's controller, which shuts down when the kernel that started it dies.

A notebook kernel killed mid-cell (restarted by the user, or by nbval) never runs `handle.stop()`. Its engines exit
on their own (`ipengine.watch_parent`); without this, its controller (the hub, its schedulers and heart monitor:
about nine processes) stayed behind for good. Here the same parent watch sends the controller SIGTERM, which runs
ipyparallel's own shutdown (`IPController.handle_signal`: it terminates the schedulers, stops the loop, removes
the connection files); if that has not ended the process within `GRACE_S`, it exits at once. The processes the
controller forks watch it in turn (`_watch_controller`): a controller killed by SIGKILL takes them along.

The controller itself is unchanged (`ipyparallel.controller.app.main`, same arguments). `launch.make_cluster` makes
this the default `controller_cmd` of a local controller (one the caller's config does not name).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

from .ipengine import ORPHANED_EXIT, PARENT_ENV, watch_parent

CONTROLLER_CMD = [sys.executable, "-m", "mfsdp_kit.notebook.ipcontroller"]
GRACE_S = 10.0
"""Seconds ipyparallel's shutdown gets after SIGTERM before the controller exits regardless."""


def shut_down() -> None:
    """ipyparallel's shutdown (SIGTERM to the main thread, where its handler runs), then, if that has not ended the
    process within GRACE_S, SIGKILL to its process group (the launcher starts it as a session leader, so the group is
    the hub's schedulers and heart monitor, which `os._exit` alone would leave running) and `os._exit`."""
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    time.sleep(GRACE_S)
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(ORPHANED_EXIT)


def _watch_controller() -> None:
    """In each process the controller forks (the hub's schedulers and heart monitor: multiprocessing's fork): exit
    once the controller is gone. A controller killed by SIGKILL runs no shutdown, and its forked children (the
    watch thread is not copied by fork) stayed behind for good, re-parented to init, holding their ports."""
    os.environ.pop(PARENT_ENV, None)   # the parent to watch is the controller, not the kernel
    watch_parent()


def main() -> None:
    watch_parent(on_orphan=shut_down)
    os.register_at_fork(after_in_child=_watch_controller)
    from ipyparallel.controller.app import main as controller_main
    controller_main()


if __name__ == "__main__":
    main()
