"""Starting and stopping engines with ipyparallel's own launchers, and timing where the start goes.

`cluster.start` owns the world (ranks, rendezvous, `runtime.init`); this module owns the processes:
the checks of `start`'s arguments before any process exists (`check_start`), the kit's defaults for ipyparallel's `Cluster` (its own engine, ipengine.py, for local engines, spawned before
the controller so that their boot overlaps the controller's), OpenMPI's switches for `engines="mpi"`, waiting
for engines to register (failing at once when the launcher itself exited, e.g. `mpiexec` refusing to run),
and killing engines stuck in a collective. Where the start's time goes is a `distributed.stopwatch.Stopwatch`.
"""
from __future__ import annotations

import copy
import os
import signal
import sys
import time
from typing import Any

import ipyparallel as ipp
from ipyparallel.cluster import launcher as launchers
from traitlets.config import Config, LazyConfigValue

from .. import cache
from ..config import BACKENDS, ConfigError, bad_value
from ..fieldtypes import is_int
from ..distributed.stopwatch import Stopwatch
from . import stacks

LOCAL_LAUNCHERS = ("local", "localengine", "localenginesetlauncher", "")
LOCAL_CONTROLLERS = ("local", "localcontroller", "localcontrollerlauncher", "")
MPI_LAUNCHERS = ("mpi", "mpiengine", "mpienginesetlauncher", "mpiexec")
ENGINE_CMD = [sys.executable, "-m", "mfsdp_kit.notebook.ipengine"]
"""The kit's engine (ipengine.py): ipyparallel's engine that may start before the controller and imports torch
and megatron at boot (unless `ipengine.PRELOAD_ENV` is '0'). The default `engine_cmd` of local engines, and of
MPI engines where this machine has PRELOAD_MIN_CORES_PER_ENGINE cores per engine or more."""
PRELOAD_MIN_CORES_PER_ENGINE = 4
"""bench/cluster_start.py, start() to ready on 2 engines: a 32-core GPU node 12.3 -> 10.8 s and, on a slower
one, 17.3 -> 14.7 s with the imports at boot; 2 busy CPU cores were slower with them (the import thread and
the registration share the engine's GIL and the cores), when engines were spawned after the controller. It now
decides for MPI engines only: local ones are spawned first and import at boot everywhere (2 busy cores included)."""
CONTROLLER_ARGS = ["--HeartMonitor.period=250", "--HeartMonitor.max_heartmonitor_misses=120"]
SIGNAL_REPLY_S = 10.0
"""Seconds `kill_engines` waits for the nannies of engines under mpiexec & co to confirm their SIGKILL (a request
through the controller: a dead one never answers, and `stop()` goes on to stop mpiexec)."""
OPENMPI_OVERSUBSCRIBE = {"OMPI_MCA_rmaps_base_oversubscribe": "1"}
"""OpenMPI refuses more ranks than cores; an engine mostly waits (one per GPU), so the kit allows it."""
OPENMPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
"""OpenMPI's documented switch for running as root (containers); the kit sets it only when euid is 0."""


class ClusterError(RuntimeError):
    """The engine world cannot be (or is no longer) used; the message says which rank and what to do."""


class ClusterConfigError(ClusterError, ConfigError):
    """A `start` argument is not allowed; raised before anything starts. Both a `ClusterError` (what
    `start` raises) and a `ConfigError` / `ValueError` (what a bad value is everywhere else in the kit)."""


DEVICES = ("auto", "cpu")
"""`cluster.start(device=)`: "auto" = one GPU per engine where this machine has GPUs, else the CPU; "cpu" = local
engines that see no GPU (gloo, CPU tensors) on any machine: two ranks on a node with one GPU, say."""
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}
"""An engine with this environment sees no GPU: the CUDA driver reports none, torch's device is the CPU."""


def check_start(*, n: Any, backend: Any, timeout_s: Any, device_count: Any, device: Any, launcher: dict,
                stall_s: Any, collective_timeout_s: Any = None, cell_timeout_s: Any = None) -> None:
    """`cluster.start`'s arguments, checked before anything starts: a ClusterConfigError naming the bad one."""
    def bad(field_name: str, value: Any, allowed: str) -> ClusterConfigError:
        return ClusterConfigError(str(bad_value(field_name, value, allowed)))

    def seconds(value: Any) -> bool:
        return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < float("inf")
    for name, value in dict(stall_s=stall_s, cell_timeout_s=cell_timeout_s).items():
        if not (seconds(value) or (value is None and name != "stall_s")):
            raise bad(name, value, "a finite number of seconds > 0" + " or None" * (name != "stall_s"))
    if collective_timeout_s is not None and (not is_int(collective_timeout_s) or collective_timeout_s < 1):
        raise bad("collective_timeout_s", collective_timeout_s, "None (the config's, 600) or an integer >= 1 (seconds)")
    if backend not in BACKENDS:
        raise bad("backend", backend, " | ".join(BACKENDS))
    if device_count is not None and (not is_int(device_count) or device_count < 0):
        raise bad("device_count", device_count, "None or an integer >= 0")
    if n is not None and (not is_int(n) or n < 1):
        raise bad("n", n, "None (one engine per GPU, else 2) or an integer >= 1")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise bad("timeout_s", timeout_s, "a finite number of seconds > 0")
    if device not in DEVICES:
        raise bad("device", device, " | ".join(DEVICES))
    if device == "cpu" and backend == "nccl":
        raise bad("backend", backend, "auto | gloo with device='cpu' (NCCL needs a GPU per engine)")
    if device == "cpu" and kind(launcher) != "local":   # the kit sets the environment only of engines it spawns
        raise bad("device", device, "'auto' with engines= other than local; for CPU engines there, run them on "
                  "CPU nodes or set CUDA_VISIBLE_DEVICES='' in that launcher's environment")


def with_profile(launcher: dict) -> dict:
    """`launcher` with its ipyparallel profile's ipcluster_config.py folded into `config` as ipyparallel merges
    them (the caller's config wins), and `load_profile=False`. The kit's defaults then fill only what neither
    names: a site profile's engine_cmd, controller_cmd, environment, engine launcher or controller_args is kept."""
    mine = Config(launcher.get("config") or {})
    if launcher.get("load_profile", configured(mine, ipp.Cluster, "load_profile")) in (False, 0):
        return launcher
    where = {k: launcher[k] for k in ("profile", "profile_dir") if k in launcher}
    profile = ipp.Cluster(**where, config=Config()).profile_config   # runs the file, as ipyparallel would
    config = Config()
    config.merge(profile)
    config.merge(mine)
    return {**launcher, "config": config, "load_profile": False}


def configured(config: Config, cls: type, key: str, empty: Any = None) -> Any:
    """What `config` gives trait `key` of class `cls`, as traitlets resolves it: its MRO's sections from the most
    general on (`c.EngineLauncher.engine_cmd` reaches every engine launcher), a value replacing, a profile's
    `.append(...)` / `.update(...)` applied to what is there (`empty`, the trait's default, at first); None where
    no section sets it."""
    value, found = empty, False
    for klass in reversed(cls.__mro__):
        if klass.__name__ in config and key in config[klass.__name__]:
            got = config[klass.__name__][key]
            value, found = (got.get_value(copy.deepcopy(value)) if isinstance(got, LazyConfigValue) else got), True
    return value if found else None


def kind(launcher: dict) -> str:
    """'local' | 'mpi' | 'other' for the engine launcher chosen by `engines=` (or the config's Cluster section)."""
    name = _launcher_name(launcher, "engines", "engine_launcher_class")
    return "local" if name in LOCAL_LAUNCHERS else "mpi" if name in MPI_LAUNCHERS else "other"


def _launcher_name(launcher: dict, alias: str, trait: str) -> str:
    """The lower-case class or entry-point name of a launcher (e.g. 'mpi', 'mpienginesetlauncher'), chosen by
    the `alias=` argument, the trait of that name, or the config's `Cluster.<trait>`; '' for ipyparallel's own."""
    value = launcher.get(alias) or launcher.get(trait) or configured(Config(launcher.get("config") or {}), ipp.Cluster,
                                                                     trait)
    name = value.__name__ if isinstance(value, type) else str(value or "")
    return name.rsplit(".", 1)[-1].lower()


def openmpi_env() -> dict[str, str]:
    """The OpenMPI variables the kit sets on `mpiexec` for `engines="mpi"`, minus any the user already set
    (MPICH and others ignore them). Set one yourself (e.g. `OMPI_MCA_rmaps_base_oversubscribe=0`) to override."""
    env = dict(OPENMPI_OVERSUBSCRIBE)
    if os.geteuid() == 0:
        env.update(OPENMPI_AS_ROOT)
    return {k: v for k, v in env.items() if k not in os.environ}


def make_cluster(*, n: int, ip: str, timeout_s: float, launcher: dict, see_gpus: bool = True) -> ipp.Cluster:
    """ipyparallel's `Cluster` with the kit's defaults; anything in `launcher` wins over them.
    `see_gpus=False`: local engines get `CUDA_VISIBLE_DEVICES=""` (HIDE_GPUS), so torch runs them on the CPU."""
    # the kit adds to the config below; the caller's object stays as it was
    launcher = dict(with_profile(launcher))   # with_profile: a no-op where cluster.start did it
    launcher["config"] = copy.deepcopy(Config(launcher.get("config") or {}))
    config = launcher["config"]
    # The hub finishes a registration on its next heartbeat: with ipyparallel's 3 s period every start and
    # restart waited 0-3 s for it (bench: register took 6.0, 9.0, 12.0 s). 0.25 s (register 0.90 s idle; 0.5 s:
    # 1.36 s), with as many seconds of silence tolerated as before (120 x 0.25 s); a dead engine is still noticed
    # at once, through its nanny.
    launcher["controller_args"] = [*CONTROLLER_ARGS, *launcher.get(
        "controller_args", configured(config, ipp.Cluster, "controller_args", []) or [])]
    # delay: engines wait for the connection info anyway (send_engines_connection_env)
    for name, value in (("log_level", 40), ("delay", 0)):
        if name not in launcher and configured(config, ipp.Cluster, name) is None:   # set only if neither sets it
            launcher[name] = value
    # Local engines import at boot everywhere: spawned before the controller, that won on 2 busy cores too
    # (bench/cluster_start.py: ready 3.9 -> 3.0 s); MPI engines (spawned after it) only with cores to spare.
    preload = kind(launcher) == "local" or preload_by_default(n_engines=n, cores=len(os.sched_getaffinity(0)))
    set_default_engine_cmd(launcher, preload=preload, connection_wait_s=timeout_s)
    set_default_controller_cmd(launcher)
    if kind(launcher) == "local":
        add_environment(config, launchers.LocalEngineSetLauncher, engine_threads_env(n, len(os.sched_getaffinity(0))))
    if not see_gpus:
        add_environment(config, launchers.LocalEngineSetLauncher, HIDE_GPUS, over=True)
    cluster = ipp.Cluster(n=n, controller_ip=ip, engine_timeout=max(1, int(timeout_s)), **launcher)
    if kind(launcher) == "mpi":
        add_environment(cluster.config, launchers.MPIEngineSetLauncher, openmpi_env())
    return cluster


def engine_threads_env(n_engines: int, cores: int) -> dict[str, str]:
    """OMP_NUM_THREADS for `n_engines` local engines, the cores split among them (as torchrun does; {} where this
    process sets it). torch's default, every core in each engine: 2 CPU engines on 2 cores, 5x slower training."""
    return {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": str(max(1, cores // max(n_engines, 1)))}


def preload_by_default(*, n_engines: int, cores: int) -> bool:
    """Whether engines import torch/megatron at boot unless the caller chose an engine_cmd or set PRELOAD_ENV."""
    return cores >= PRELOAD_MIN_CORES_PER_ENGINE * max(n_engines, 1)


def set_default_engine_cmd(launcher: dict, *, preload: bool = True, connection_wait_s: float = 120.0) -> None:
    """The kit's engine (ENGINE_CMD) for local engines, and for MPI ones when `preload`, unless the caller's
    config names an engine_cmd. Local engines the kit picks get `ipengine.PRELOAD_ENV=0` when not `preload`
    (unless it is set in this process's environment, which they inherit); every local engine set starts its
    engines at once (ipyparallel waits 0.1 s between two) and may wait `connection_wait_s` for the controller.
    Both keep the bytecode of what they import (`cache.bytecode_env`)."""
    from .ipengine import PARENT_ENV, PRELOAD_ENV, WAIT_ENV
    section = {"local": "LocalEngineSetLauncher", "mpi": "MPIEngineSetLauncher"}.get(kind(launcher))
    if section is None or (section == "MPIEngineSetLauncher" and not preload):
        return   # slurm, ssh, ...: engines start elsewhere; their command is the user's business
    config, cls = launcher.setdefault("config", Config()), getattr(launchers, section)
    env = cache.bytecode_env()   # an image with PYTHONDONTWRITEBYTECODE=1 recompiles torch at every start
    if section == "LocalEngineSetLauncher":
        env[WAIT_ENV] = f"{connection_wait_s:g}"
        env[PARENT_ENV] = str(os.getpid())   # the launcher, for ipengine.watch_parent
        if configured(config, cls, "delay") is None:
            config[section].delay = 0.0
    if configured(config, cls, "engine_cmd") is None:
        config[section].engine_cmd = ENGINE_CMD
        if section == "LocalEngineSetLauncher" and not preload and PRELOAD_ENV not in os.environ:
            env[PRELOAD_ENV] = "0"
    add_environment(config, cls, env)


def add_environment(config: Config, cls: type, env: dict[str, str], *, over: bool = False) -> None:
    """Set `cls`'s environment in `config` to what it resolves to (`configured`) plus `env`: the config's own
    values win unless `over`. Set on `cls` itself, so a more general section's values must be copied in."""
    if env:
        mine = configured(config, cls, "environment", {}) or {}
        config[cls.__name__].environment = {**mine, **env} if over else {**env, **mine}


def set_default_controller_cmd(launcher: dict) -> None:
    """The kit's controller (ipcontroller.py: it shuts down when this kernel dies) for a local controller, unless
    the caller's config names a controller_cmd."""
    from .ipcontroller import CONTROLLER_CMD
    from .ipengine import PARENT_ENV
    if _launcher_name(launcher, "controller", "controller_launcher_class") not in LOCAL_CONTROLLERS:
        return   # slurm, ssh, mpi: the controller runs elsewhere, under the user's command
    config = launcher.setdefault("config", Config())
    if configured(config, launchers.LocalControllerLauncher, "controller_cmd") is None:
        config.LocalControllerLauncher.controller_cmd = CONTROLLER_CMD
        add_environment(config, launchers.LocalControllerLauncher, {PARENT_ENV: str(os.getpid())})


def engines_find_controller(cluster: ipp.Cluster) -> bool:
    """Whether `cluster`'s engines are local ones running the kit's engine, which wait for the controller's
    connection file themselves (ipengine.py), so they can be spawned before the controller."""
    cls = cluster.engine_launcher_class
    return (isinstance(cls, type) and issubclass(cls, launchers.LocalEngineSetLauncher)
            and "mfsdp_kit.notebook.ipengine" in (configured(cluster.config, cls, "engine_cmd") or []))


def start_processes(cluster: ipp.Cluster, n: int, watch: Stopwatch) -> ipp.Client:
    """n engines, the controller and a client; each a phase of `watch`.

    The kit's local engines are spawned first: they boot (and import torch) while the controller does, then
    read its connection file. Other engines (plain ipyparallel ones, MPI, Slurm, whose nodes may not see this
    filesystem) are spawned once the controller is up, with its connection info in `$IPP_CONNECTION_INFO`.
    """
    if engines_find_controller(cluster):
        cluster.start_engines_sync(n)
        watch.lap("engines_spawn")
        cluster.start_controller_sync()
        watch.lap("controller")
    else:
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
    (SIGKILL to mpiexec itself would orphan its engines). Over copies of ipyparallel's dicts: its own thread
    drops an engine's launcher (and an engine set) from them as soon as it notices the process end.
    """
    for engine_set in list(cluster.engines.values()):
        launchers = getattr(engine_set, "launchers", None)
        for launcher in list((launchers or {}).values()):
            _quietly(launcher.signal, signal.SIGKILL)
        if launchers is None and client.ids and controller_error(cluster) is None:
            _quietly(lambda: client.send_signal(signal.SIGKILL, targets=client.ids, block=False).result(
                timeout=SIGNAL_REPLY_S))


def stop(cluster: ipp.Cluster, client: ipp.Client | None) -> None:
    """Close the client, stop engines and controller (ipyparallel), then end what the controller left
    (`end_controller_group`) and remove the engines' stack files (`stacks.py`): nothing of the cluster runs, listens
    or stays on disk afterwards."""
    controller = controller_process(cluster)   # ipyparallel forgets it when it stops the cluster
    if client is not None:
        client.close()
    try:
        cluster.stop_cluster_sync()
    finally:
        if controller is not None:
            end_controller_group(controller.pid)
        stacks.remove(profile_dir=cluster.profile_dir, cluster_id=cluster.cluster_id)


# ---- the controller: its death named, its process group ended ----------------------------------
def controller_process(cluster: ipp.Cluster) -> Any:
    """The local controller's `psutil.Process` (ipyparallel's launcher holds it); None for one run elsewhere."""
    return getattr(getattr(cluster, "controller", None), "process", None)


def controller_error(cluster: ipp.Cluster) -> ClusterError | None:
    """A ClusterError naming the local controller once its process has exited; None while it runs (or when it
    runs elsewhere: slurm, ssh). Every message between this kernel and the engines goes through the controller,
    so a cell whose controller died would wait forever (146 s and counting, in issue 51) for a reply."""
    import psutil
    proc = controller_process(cluster)
    if proc is None:
        return None
    try:
        if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
            return None
    except psutil.Error:
        pass
    launcher = cluster.controller
    try:
        code = proc.wait(timeout=0.5)   # this kernel is its parent; ipyparallel's watcher thread may have reaped it
    except (psutil.Error, ChildProcessError):
        code = None
    code = code if code is not None else (getattr(launcher, "stop_data", None) or {}).get("exit_code")
    how = f" (exit code {code}{', SIGKILL' if code == -signal.SIGKILL else ''})" if code is not None else ""
    command = " ".join(map(str, getattr(launcher, "args", [])[:3]))
    return ClusterError(f"the ipyparallel controller (pid {proc.pid}: {command}) died{how}: every message between "
                        "this kernel and the engines goes through it, so they cannot be reached and this cluster is "
                        "lost. Run handle.stop() (it ends the engines and what the controller left), then "
                        "cluster.start(...) for a new cluster; handle.restart() needs a live controller")


def end_controller_group(pid: int, *, timeout_s: float = 10.0) -> None:
    """SIGKILL what is left of the process group of the local controller `pid` and wait until it is gone.
    ipyparallel starts the controller in a session of its own, so its pid is the group's id; the hub's schedulers and heart monitor
    are its forked children, and a controller killed by SIGKILL left them running for good (8 processes holding
    18 loopback ports after `stop()`, in issue 51). Only this user's processes of that group are signalled."""
    if pid == os.getpgrp():   # a controller that shares this kernel's group (a custom launcher): not ours to end
        return
    deadline = time.monotonic() + timeout_s
    while left := _group_members(pid):
        for p in left:
            _quietly(p.kill)
        if time.monotonic() > deadline:
            raise ClusterError(f"the controller's processes {[p.pid for p in left]} (group {pid}) still run "
                               f"{timeout_s} s after SIGKILL")
        time.sleep(0.05)


def _group_members(pgid: int) -> list:
    import psutil
    out = []
    for p in psutil.process_iter(["uids", "status"]):
        try:
            if (p.pid != os.getpid() and os.getpgid(p.pid) == pgid and p.info["uids"].real == os.getuid()
                    and p.info["status"] != psutil.STATUS_ZOMBIE):
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 -- the engine that died is already gone
        pass
