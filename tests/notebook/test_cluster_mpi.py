"""cluster.start(engines="mpi") on one CPU host: OpenMPI's mpiexec (through ipyparallel's own MPI launcher)
starts the engines, ranks come from OMPI_COMM_WORLD_RANK, and restart / stop leave no process behind.

Needs Debian's `openmpi-bin` (mpiexec) and `mpi4py` (ipyparallel's MPI engines import it); skipped without."""
import importlib.util
import os
import shutil
import signal
import threading
import time

import psutil
import pytest

from mfsdp_kit.notebook import cluster, launch

pytestmark = [
    pytest.mark.skipif(shutil.which("mpiexec") is None,
                       reason="mpiexec is not on PATH (Debian: apt-get install -y openmpi-bin libopenmpi-dev)"),
    pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None,
                       reason="mpi4py is not installed (ipyparallel's `ipengine --mpi` imports it): pip install mpi4py"),
]
ALL_REDUCE = "import torch, torch.distributed as dist\nx = torch.tensor([rank + 1.0])\ndist.all_reduce(x)"
WHO = "import os\nompi_rank = int(os.environ['OMPI_COMM_WORLD_RANK'])\npid = os.getpid()"


def _descendants() -> dict[int, psutil.Process]:
    """Every process this test started (controller, mpiexec, engines, their nannies), by pid."""
    return {p.pid: p for p in psutil.Process().children(recursive=True)}


def _assert_gone(seen: dict[int, psutil.Process], before: set[int]) -> None:
    """Every process seen that was not there before has exited (a zombie counts as gone) within 20 s."""
    started = [p for pid, p in seen.items() if pid not in before]
    psutil.wait_procs(started, timeout=20)
    assert not [(p.pid, p.name()) for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _check_world(handle) -> list[int]:
    """Each engine's rank is its OpenMPI rank; an all-reduce spans them. Returns the engines' pids."""
    handle.run(WHO)
    assert handle.view["ompi_rank"] == handle.view["rank"] == [0, 1]
    handle.run(ALL_REDUCE)
    assert [float(x) for x in handle.view["x"]] == [3.0, 3.0]
    return handle.view["pid"]


def test_mpi_engines_rank_all_reduce_restart_and_stop_leave_nothing():
    before = set(_descendants())
    handle = cluster.start(2, engines="mpi", timeout_s=180)
    seen = {}
    try:
        seen.update(_descendants())
        assert any("mpiexec" in " ".join(p.cmdline()) for p in seen.values()), "mpiexec should launch the engines"
        first_pids = _check_world(handle)
        handle.restart()
        seen.update(_descendants())
        second_pids = _check_world(handle)
        assert not set(first_pids) & set(second_pids), "restart should start fresh engine processes"
        assert handle.ranks == [0, 1]
    finally:
        handle.stop()
    _assert_gone(seen, before)


def test_stop_after_the_controller_died_returns_and_leaves_nothing():
    """MPI engines are killed through their nannies, by a signal request that goes through the controller. With the
    controller dead no reply comes: stop() must not wait for one, and mpiexec's engines must still go."""
    before = set(_descendants())
    handle = cluster.start(2, engines="mpi", timeout_s=180)
    seen = dict(_descendants())
    _check_world(handle)
    os.kill(launch.controller_process(handle.cluster).pid, signal.SIGKILL)
    time.sleep(2)   # the client has noticed by then: its signal request waits for a reply (it hung forever)
    outcome = []
    stopper = threading.Thread(target=lambda: outcome.append(_outcome(handle.stop)), daemon=True)
    stopper.start()
    stopper.join(60)
    assert outcome == [None], outcome or "stop() still waits 60 s after the controller died"
    _assert_gone(seen, before)


def _outcome(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 -- the test shows it
        return err
    return None
