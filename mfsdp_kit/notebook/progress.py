"""Progress across ranks, both ends.

Engine side: `report(step=, total=, **metrics)` (the same function as `distributed.progress.report`, which the kit's loops
call) reaches the notebook through `publish`, which `cluster.start` installs as a listener on every engine; anywhere
else (scripts, torchrun) nobody listens. Notebook side: `ProgressPanel` draws one bar and one metrics line per rank
from what the ranks reported; `run_with_progress` / `run_with_panel` (also `cluster.X`) feed it while a cell runs."""
from __future__ import annotations

import sys
from typing import Any

from ..distributed.progress import report  # noqa: F401  (cluster.report: user code on the engines reports with it)


def _engine_shell():
    """The engine's shell when running inside an ipyparallel engine, else None."""
    if "ipyparallel" not in sys.modules:  # an engine has imported it; nothing else needs to
        return None
    from IPython.core.interactiveshell import InteractiveShell
    from ipyparallel.engine.kernel import IPythonParallelKernel
    # Ask the base class: a plain InteractiveShell (IPython in a terminal or a test) is a sibling
    # singleton that ZMQInteractiveShell.instance() would refuse with MultipleInstanceError.
    shell = InteractiveShell.instance() if InteractiveShell.initialized() else None
    return shell if isinstance(getattr(shell, "kernel", None), IPythonParallelKernel) else None


def publish(data: dict) -> None:
    """Send one report to the notebook (ipyparallel's data publication, polled through `AsyncResult.data`); a no-op
    outside an engine. `on_engine.init` makes it a `distributed.progress` listener."""
    shell = _engine_shell()
    if shell is not None:
        shell.data_pub.publish_data(data)


class ProgressPanel:
    """One bar and one line of metrics per rank; ipywidgets in a notebook, plain text elsewhere."""

    def __init__(self, ranks: list[int]):
        self.ranks = ranks
        self.last: dict[int, dict] = {}
        self._bars, self._labels, self._box = {}, {}, None
        try:
            from IPython import get_ipython
            import ipywidgets as w
        except ImportError:
            return
        if get_ipython() is None:
            return
        from IPython.display import display
        for r in ranks:
            self._bars[r] = w.IntProgress(value=0, min=0, max=1, description=f"rank {r}")
            self._labels[r] = w.Label("")
        self._box = w.VBox([w.HBox([self._bars[r], self._labels[r]]) for r in ranks])
        display(self._box)

    def update(self, data_by_rank: dict[int, dict]) -> None:
        for r, data in data_by_rank.items():
            if not data:
                continue
            self.last[r] = dict(data)
            if r in self._bars:
                total = data.get("total") or max(data.get("step", 0), 1)
                self._bars[r].max, self._bars[r].value = total, data.get("step", 0)
                self._labels[r].value = self.text(r)

    def text(self, rank: int) -> str:
        data = self.last.get(rank, {})
        metrics = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in data.items() if k not in ("step", "total"))
        return f"step {data.get('step', '-')}/{data.get('total') or '?'} {metrics}".strip()


def run_with_progress(handle: Any, fn_or_code: Any, *args: Any, poll_s: float = 0.25,
                      timeout_s: float | None = None, **kwargs: Any) -> tuple[list, ProgressPanel]:
    """Run a function (or code string) on every rank of `handle` (`cluster.start`) while showing what each rank
    `report`s. Returns (results in rank order, the panel with the last reported data per rank)."""
    panel = ProgressPanel(handle.ranks)
    results = run_with_panel(handle, panel, fn_or_code, *args, poll_s=poll_s, timeout_s=timeout_s, **kwargs)
    return results, panel


def run_with_panel(handle: Any, panel: Any, fn_or_code: Any, *args: Any, poll_s: float = 0.25,
                   timeout_s: float | None = None, **kwargs: Any) -> list:
    """`run_with_progress` with a panel of your own: anything with `update({rank: data})`, such as
    `widgets.TrainingPanel` (live loss curve, tokens/s, memory per rank). Returns results in rank order
    (Stop: `handle.wait` pauses every rank at one step boundary, `notebook/interrupt.py`)."""
    if isinstance(fn_or_code, str):
        ar = handle.view.execute(fn_or_code, block=False)
    else:
        ar = handle.view.apply_async(fn_or_code, *args, **kwargs)

    def refresh(result: Any) -> None:
        panel.update(dict(zip(handle.ranks, result.data)))

    results = handle.wait(ar, timeout_s=timeout_s, poll_s=poll_s, on_poll=refresh)
    ar.wait_for_output(timeout=5)  # published data travels on IOPub and can trail the result
    refresh(ar)
    return results
