"""Engine-side progress: `report(step=, total=, **metrics)` publishes to the notebook when the
code runs on an ipyparallel engine, and does nothing anywhere else (scripts, torchrun, a GPU
node without ipyparallel installed). The client side that draws it lives in cluster.py."""
from __future__ import annotations

import sys
from typing import Any


def _engine_shell():
    """The engine's shell when running inside an ipyparallel engine, else None."""
    if "ipyparallel" not in sys.modules:  # an engine has imported it; nothing else needs to
        return None
    from ipykernel.zmqshell import ZMQInteractiveShell
    from ipyparallel.engine.kernel import IPythonParallelKernel
    shell = ZMQInteractiveShell.instance() if ZMQInteractiveShell.initialized() else None
    return shell if isinstance(getattr(shell, "kernel", None), IPythonParallelKernel) else None


def report(*, step: int, total: int | None = None, **metrics: Any) -> None:
    """Publish this rank's progress to the notebook (`cluster.run_with_progress` shows it)."""
    shell = _engine_shell()
    if shell is not None:
        shell.data_pub.publish_data(dict(step=step, total=total, **metrics))
