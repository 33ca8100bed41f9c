"""Starting and stopping engines with ipyparallel's own launchers, and timing where the start goes.

`cluster.start` owns the world (ranks, rendezvous, `runtime.init`); this module owns the processes:
the kit's defaults for ipyparallel's `Cluster`, OpenMPI's switches for `engines="mpi"`, waiting for
engines to register (failing at once when the launcher itself exited, e.g. `mpiexec` refusing to run),
killing engines stuck in a collective, and `Stopwatch`, the per-phase record behind `handle.startup_s`
and bench/cluster_start.py.
"""
from __future__ import annotations

import copy
import os
import signal
import sys
import time
from typing import Any

import ipyparallel as ipp

from .config import ConfigError

LOCAL_LAUNCHERS = ("local", "localengine", "localenginesetlauncher", "")
MPI_LAUNCHERS = ("mpi", "mpiengine", "mpienginesetlauncher", "mpiexec")
PRELOAD_ENGINE_CMD = [sys.executable, "-m", "mfsdp_kit.ipengine"]
"""`engine_cmd` for local / MPI engines: ipyparallel's engine behind a thread importing torch and megatron at boot
(ipengine.py). The default where this machine has PRELOAD_MIN_CORES_PER_ENGINE cores per engine or more."""
PRELOAD_MIN_CORES_PER_ENGINE = 4
"""bench/cluster_start.py, start() to ready on 2 engines: a 32-core GPU node 12.3 -> 10.8 s and, on a slower
one, 17.3 -> 14.7 s with the preloading engine; 2 busy CPU cores were slower with it (the import thread and
the registration share the engine's GIL and the cores)."""
CONTROLLER_ARGS = ["--HeartMonitor.period=250", "--HeartMonitor.max_heartmonitor_misses=120"]
OPENMPI_OVERSUBSCRIBE = {"OMPI_MCA_rmaps_base_oversubscribe": "1"}
"""OpenMPI refuses more ranks than cores; an engine mostly waits (one per GPU), so the kit allows it."""
OPENMPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
"""OpenMPI's documented switch for running as root (containers); the kit sets it only when euid is 0."""


class ClusterError(RuntimeError):
    """The engine world cannot be (or is no longer) used; the message says which rank and what to do."""


class ClusterConfigError(ClusterError, ConfigError):
    """A `start` argument is not allowed; raised before anything starts. Both a `ClusterError` (what
    `start` raises) and a `ConfigError` / `ValueError` (what a bad value is everywhere else in the kit)."""


class Stopwatch:
    """Seconds per phase, in the order the phases ran: `lap("register")` closes the phase since the last lap."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = self._start = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now

    def total(self) -> float:
        return time.perf_counter() - self._start


def kind(launcher: dict) -> str:
    """'local' | 'mpi' | 'other' for the `engines=` passed through to ipyparallel."""
    name = str(launcher.get("engines", "")).lower()
    return "local" if name in LOCAL_LAUNCHERS else "mpi" if name in MPI_LAUNCHERS else "other"


def openmpi_env() -> dict[str, str]:
    """The OpenMPI variables the kit sets on `mpiexec` for `engines="mpi"`, minus any the user already set
    (MPICH and others ignore them). Set one yourself (e.g. `OMPI_MCA_rmaps_base_oversubscribe=0`) to override."""
    env = dict(OPENMPI_OVERSUBSCRIBE)
    if os.geteuid() == 0:
        env.update(OPENMPI_AS_ROOT)
    return {k: v for k, v in env.items() if k not in os.environ}


def make_cluster(*, n: int, ip: str, timeout_s: float, launcher: dict) -> ipp.Cluster:
    """ipyparallel's `Cluster` with the kit's defaults; anything in `launcher` wins over them."""
    if "config" in launcher:   # the kit adds to it below; the caller's object stays as it was
        launcher["config"] = copy.deepcopy(launcher["config"])
    # The hub finishes a registration on its next heartbeat: with ipyparallel's 3 s period every start and
    # restart waited 0-3 s for it (bench: register took 6.0, 9.0, 12.0 s). 0.25 s (register 0.90 s idle; 0.5 s:
    # 1.36 s), with as many seconds of silence tolerated as before (120 x 0.25 s); a dead engine is still noticed
    # at once, through its nanny.
    launcher["controller_args"] = [*CONTROLLER_ARGS, *launcher.get("controller_args", [])]
    launcher.setdefault("log_level", 40)
    launcher.setdefault("delay", 0)   # engines wait for the connection info anyway (send_engines_connection_env)
    if preload_by_default(n_engines=n, cores=len(os.sched_getaffinity(0))):
        set_default_engine_cmd(launcher)
    cluster = ipp.Cluster(n=n, controller_ip=ip, engine_timeout=max(1, int(timeout_s)), **launcher)
    if kind(launcher) == "mpi":
        mpi = cluster.config.MPIEngineSetLauncher
        mpi.environment = {**openmpi_env(), **mpi.get("environment", {})}
    return cluster


def preload_by_default(*, n_engines: int, cores: int) -> bool:
    """Whether engines preload torch/megatron at boot (PRELOAD_ENGINE_CMD) unless the caller chose an engine_cmd."""
    return cores >= PRELOAD_MIN_CORES_PER_ENGINE * max(n_engines, 1)


def set_default_engine_cmd(launcher: dict) -> None:
    """PRELOAD_ENGINE_CMD as the local / MPI engine command, unless the caller's config names one."""
    from traitlets.config import Config
    section = {"local": "LocalEngineSetLauncher", "mpi": "MPIEngineSetLauncher"}.get(kind(launcher))
    if section is None:   # slurm, ssh, ...: engines start elsewhere; their command is the user's business
        return
    config = launcher.setdefault("config", Config())
    if "engine_cmd" not in config[section]:
        config[section].engine_cmd = PRELOAD_ENGINE_CMD


def start_processes(cluster: ipp.Cluster, n: int, watch: Stopwatch) -> ipp.Client:
    """Controller, then n engines, then a client; each a phase of `watch`."""
    cluster.start_controller_sync()
    watch.lap("controller")
    cluster.start_engines_sync(n)
    watch.lap("engines_spawn")
    client = cluster.connect_client_sync()
    watch.lap("client_connect")
    return client


def wait_for_new_engines(cluster: ipp.Cluster, client: ipp.Client, old_ids: set, n: int,
                         timeout_s: float) -> list[int]:
    """The ids of n engines registered after `old_ids`; fails at once if an engine launcher exited."""
    deadline = time.monotonic() + timeout_s
    while len(new := sorted(set(client.ids) - old_ids)) < n:
        if exited := _exited_launchers(cluster):
            raise ClusterError(f"only {len(new)} of {n} engines registered: the launcher exited before the "
                               f"others did. {exited}")
        if time.monotonic() > deadline:
            raise ClusterError(f"only {len(new)} of {n} engines registered within timeout_s={timeout_s}; "
                               "engine logs are in the profile's log/ folder (`ipython locate profile`)")
        time.sleep(0.05)
    return new[:n]


def wait_until_unregistered(client: ipp.Client, old_ids: set, timeout_s: float) -> None:
    """Return once the controller has dropped every engine in `old_ids`. MPI engines ask for their MPI rank
    as engine id, so a restart's engines reuse the old ids: they must be free before the new ones register."""
    deadline = time.monotonic() + timeout_s
    while left := old_ids & set(client.ids):
        if time.monotonic() > deadline:
            raise ClusterError(f"engines {sorted(left)} still registered {timeout_s} s after they were killed")
        time.sleep(0.05)


def _exited_launchers(cluster: ipp.Cluster) -> str:
    """'<command> exited with <code>: <output tail>' for each engine launcher that stopped, else ''."""
    out = []
    for engine_set in cluster.engines.values():
        if getattr(engine_set, "state", "") == "after":
            tail = "\n".join((engine_set.get_output() or "").strip().splitlines()[-15:])
            out.append(f"{' '.join(map(str, engine_set.args[:3]))} ... exited with "
                       f"{(engine_set.stop_data or {}).get('exit_code')}:\n{tail}")
    return "\n".join(out)


def kill_engines(cluster: ipp.Cluster, client: ipp.Client) -> None:
    """SIGKILL every engine still running; a Python SIGTERM handler never runs inside a C++ collective.

    Local engines through their launchers; engines under mpiexec & co through each engine's nanny
    (SIGKILL to mpiexec itself would orphan its engines).
    """
    for engine_set in cluster.engines.values():
        launchers = getattr(engine_set, "launchers", None)
        for launcher in (launchers or {}).values():
            _quietly(launcher.signal, signal.SIGKILL)
        if launchers is None and client.ids:
            _quietly(lambda: client.send_signal(signal.SIGKILL, targets=client.ids, block=True))


def stop(cluster: ipp.Cluster, client: ipp.Client | None) -> None:
    if client is not None:
        client.close()
    cluster.stop_cluster_sync()


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 -- the engine that died is already gone
        pass
