"""notebook.launch: what `cluster.start` and `stop` do to processes, apart from a running cluster."""
import signal
from types import SimpleNamespace

from mfsdp_kit.notebook import launch


def test_kill_engines_signals_every_engine_while_ipyparallel_drops_them():
    """ipyparallel's thread pops an engine's launcher (and then its engine set) as soon as the process ends, which
    can be while `kill_engines` is still signalling the others: every engine still gets its SIGKILL, and the
    iteration does not break ("dictionary changed size during iteration", seen in 06_memory's `handle.stop()`)."""
    signalled = []
    engines = {}

    class Launcher:
        def __init__(self, set_id, engine_id):
            self.set_id, self.engine_id = set_id, engine_id

        def signal(self, sig):
            signalled.append((self.set_id, self.engine_id, sig))
            launchers = engines[self.set_id].launchers
            launchers.pop(self.engine_id)   # as ipyparallel's _notice_engine_stopped does
            if not launchers:
                engines.pop(self.set_id)

    for set_id in ("a", "b"):
        engines[set_id] = SimpleNamespace(launchers={i: Launcher(set_id, i) for i in range(3)})
    launch.kill_engines(SimpleNamespace(engines=engines), SimpleNamespace(ids=[0, 1, 2, 3, 4, 5]))
    assert sorted(signalled) == [(s, i, signal.SIGKILL) for s in ("a", "b") for i in range(3)] and engines == {}
