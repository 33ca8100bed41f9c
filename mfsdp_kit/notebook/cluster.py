"""Engines for a notebook: `start` an ipyparallel cluster whose engines are one torch.distributed world.

`start(n=2)` does what torchrun does for a script, but for `%%px` cells: it launches n engines
(ipyparallel's own launchers: local processes by default, `engines="mpi" | "slurm" | "ssh"` for
several nodes), gives each a rank that does not depend on ipyparallel's engine ids, picks a free
rendezvous port and calls `mfsdp_kit.distributed.runtime.init` on every engine. The naive version -- rank :=
engine id -- breaks on the first restart, because ipyparallel numbers new engines 2, 3, ...

A dead engine, a dead controller or one failing rank must not hang a cell: `ClusterHandle.wait` names the rank (or
the controller) that died, watchdog.py aborts the others' collectives; `restart()` / `reinit()` rebuild the world with
the same ranks. Stop pauses the kit's loops at one step boundary on every rank (interrupt.py); a stuck collective or a
frozen rank is named with its stack after `stall_s` (stall.py, from each engine's heartbeat.py); `handle.status()`
shows every rank of a long cell, and each engine's output also goes to `<log_dir>/rank<r>.log`.
`report(step=, total=, **metrics)` on engines plus `run_with_progress` give per-rank progress bars.

Processes (launchers, killing, waiting for registration, start-time phases) live in launch.py.
Everything binds to 127.0.0.1 unless `ip=` names another address -- the store, and gloo too (runtime.init
points GLOO_SOCKET_IFNAME at the loopback interface): see docs/cluster.md for what a multi-node launcher opens.
"""
from __future__ import annotations

import dataclasses
import glob
import importlib
import os
import stat
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import ipyparallel as ipp

from . import gpus, interrupt, launch, on_engine, roles, stacks, stall, status as status_view, watchdog
from ..config import EngineConfig
from ..distributed import ports
from ..distributed.stopwatch import Stopwatch
from .launch import ClusterConfigError, ClusterError  # noqa: F401  (re-exported)
from .roles import assign_ranks  # noqa: F401  (cluster.assign_ranks, re-exported)
from .progress import ProgressPanel, report, run_with_panel, run_with_progress  # noqa: F401  (cluster.X, re-exported)

LOCALHOST = "127.0.0.1"
# ---- client side ---------------------------------------------------------------------------------
@dataclass
class ClusterHandle:
    """A running world: `.view` (DirectView in rank order), `.ranks`, `.wait`, `.restart()`, `.stop()`."""

    cluster: ipp.Cluster
    client: ipp.Client
    n: int
    init_kwargs: dict
    """cfg, backend, timeout_s and master_addr, replayed by restart()."""
    rank_of: dict[int, int] = field(default_factory=dict)
    """ipyparallel engine id -> rank (engine ids change on restart, ranks do not)."""
    local_rank_of: dict[int, int] = field(default_factory=dict)
    devices: list[str] = field(default_factory=list)
    backend: str = ""
    """What the engines use ("nccl" | "gloo"), resolved from the `backend="auto"` asked for."""
    master_port: int | None = None
    view: Any = None
    world_key: str = ""
    abort_reason: str | None = None   # why the client aborted the world (watchdog.py); reinit() clears it
    startup_s: dict[str, float] = field(default_factory=dict)
    """Seconds per phase of the last start / restart (bench/cluster_start.py prints them); the engine-side
    phases (`engine.import_torch`, ...) are the slowest rank's."""
    stop_s: dict[str, float] = field(default_factory=dict)
    """Seconds per phase of `stop()`: kill_engines, stop_cluster (controller and engine processes gone)."""
    stall_s: float = stall.STALL_S
    """Seconds without a move before a rank counts as stuck or frozen (stall.py)."""
    cell_timeout_s: float | None = None
    """Opt-in: a cell running longer aborts the world (None: never)."""
    log_dir: str | None = None
    """Where each engine's output goes (`rank<r>.log`)."""
    monitor: stall.Monitor | None = None
    """The ranks' heartbeat records (stall.py), once the world is up."""
    idents: dict[int, dict] = field(default_factory=dict)
    """rank -> the engine's pid and host."""
    logs: dict[int, str] = field(default_factory=dict)
    """rank -> its log file."""
    inflight: list = field(default_factory=list)
    """AsyncResults submitted through the view and not known to be done (watchdog.guard)."""
    rollout_engines: int = 0
    """Engines outside the world, linked to trainer rank 0 (roles.py): the last ranks of the n started."""
    rollout_ids: list[int] = field(default_factory=list)
    rollout_ranks: list[int] = field(default_factory=list)
    """Their launcher ranks (after the world's): their rows in `status()` and their log files."""
    rollout_view: Any = None
    """The rollout engines' DirectView (None without them)."""
    rollout_devices: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.rank_of.values())

    @property
    def engine_of(self) -> dict[int, int]:
        return {r: e for e, r in self.rank_of.items()}

    @property
    def connection_files(self) -> list[str]:
        """ipyparallel's connection files (they hold the message-signing key) and the cluster file."""
        sec = os.path.join(self.cluster.profile_dir, "security")
        return sorted(glob.glob(os.path.join(sec, f"*{self.cluster.cluster_id}*.json")))

    def __repr__(self) -> str:
        master = f"{self.init_kwargs['master_addr']}:{self.master_port}"
        rollouts = f", rollout_engines={self.rollout_devices}" if self.rollout_ids else ""
        return (f"ClusterHandle(engines={len(self.rank_of)}, ranks={self.ranks}, devices={self.devices}, "
                f"backend={self.backend!r}, master={master}{rollouts})")

    # ---- running code --------------------------------------------------------------------------
    def dead_ranks(self) -> list[int]:
        alive = set(self.client.ids)
        return sorted(r for e, r in self.rank_of.items() if e not in alive)

    def wait(self, result: Any, *, timeout_s: float | None = None, poll_s: float = 0.1,
             on_poll: Callable[[Any], None] | None = None, what: str = "", pause_on_stop: bool = True) -> list:
        """Results of an AsyncResult in rank order; `ClusterError` naming the rank if an engine dies, or the controller.
        `what`: the step waited for, named in the error when it runs out of time (else: a cell, and the world is
        aborted then, so no rank stays inside it). Stop (KeyboardInterrupt) while waiting: `interrupt.pause`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while not result.ready():
                result.wait(poll_s)
                if on_poll is not None:
                    on_poll(result)
                if lost := (self._died(dead) if (dead := self.dead_ranks()) else launch.controller_error(self.cluster)):
                    raise lost   # an engine or the controller died: no reply can come
                if deadline is not None and time.monotonic() > deadline:
                    raise self._timed_out(result, timeout_s, what)
        except KeyboardInterrupt:
            if not pause_on_stop or what:   # Stop while the world forms: start / restart / reinit give up
                raise
            return interrupt.pause(self, result)
        try:
            return result.get()
        except ipp.error.CompositeError as err:
            if self.dead_ranks():
                raise self._died(self.dead_ranks()) from err
            raise (ClusterError(watchdog.describe(self, err)) if self.abort_reason else err) from err

    def _timed_out(self, result: Any, timeout_s: float, what: str) -> ClusterError:
        if what:   # a step of forming the world: where each local engine is, from its own stacks
            where = stacks.describe(profile_dir=self.cluster.profile_dir, cluster_id=self.cluster.cluster_id)
            return ClusterError(f"{what}: no answer within timeout_s={timeout_s} (an engine busy or stuck?)"
                                + (f"\nwhere the engines are:\n{where}" if where else ""))
        watchdog.abort_world(self, f"the cell ran past timeout_s={timeout_s} s")
        result.wait(interrupt.ESCALATED_WAIT_S)   # aborted collectives return at once
        return ClusterError(f"the cell ran past timeout_s={timeout_s} s: the world's process groups are aborted on "
                            "every rank (engines and variables live on); handle.reinit() builds a new world")

    def run(self, code: str, *, timeout_s: float | None = None, pause_on_stop: bool = True) -> list:
        """Execute `code` on every rank (like a %%px cell), raising `ClusterError` if an engine dies; past the
        opt-in `timeout_s` the world is aborted (`wait`)."""
        return self.wait(self.view.execute(code, block=False), timeout_s=timeout_s, pause_on_stop=pause_on_stop)

    def apply(self, fn: Callable, *args: Any, timeout_s: float | None = None, pause_on_stop: bool = True,
              **kwargs: Any) -> list:
        """`fn(*args, **kwargs)` on every rank; the results in rank order."""
        return self.wait(self.view.apply_async(fn, *args, **kwargs), timeout_s=timeout_s, pause_on_stop=pause_on_stop)

    def abort(self, reason: str = "handle.abort()") -> None:
        """Abort the world's process groups on every rank: a rank stuck in a collective returns from it with an error.
        The engines and their variables live on; `reinit()` builds a new world."""
        watchdog.abort_world(self, reason)

    def status(self) -> "status_view.Status":
        """Every rank now: state, step, seconds since its last progress, tokens/s, memory, where it is, its log."""
        running = [a for a in self.inflight if not a.ready()]
        return status_view.Status(stall.states(self, running[-1] if running else None), stall_s=self.stall_s)

    def status_widget(self, *, period_s: float = 1.0) -> Any:
        """`status()` in a widget that refreshes every `period_s` while later cells run."""
        return status_view.widget(self, period_s=period_s)

    def _died(self, dead: list[int], *, when: str = "mid-cell") -> ClusterError:
        by_rank = stall.states(self) if self.monitor is not None else {}
        frozen = [r for r in dead if by_rank.get(r, {}).get("state") == "frozen"]
        words = [stall.describe(r, by_rank[r]) + " (ipyparallel has dropped it)" if r in frozen else
                 f"rank {r} (engine {self.engine_of[r]}) died {when}" for r in dead]
        return ClusterError("; ".join(words) + "; the process group is broken for every rank. Call handle.restart() "
                            "to rebuild the world.")

    # ---- lifecycle ------------------------------------------------------------------------------
    def reinit(self) -> "ClusterHandle":
        """A new world on the same engines (after a failure aborted the process groups); variables stay. A dead engine
        is named before anything is sent (`watchdog.check_not_stuck`, as for every cell)."""
        self.wait(self.view.apply_async(on_engine.shutdown), timeout_s=self.init_kwargs["timeout_s"],
                  what="leaving the old world")
        _setup_world(self, sorted(self.rank_of, key=self.rank_of.get) + self.rollout_ids, Stopwatch())
        return self

    def relink(self) -> "ClusterHandle":
        """A new trainer -> rollout link (`link` on trainer rank 0 and the rollout engines), e.g. after Stop closed
        it (roles.py)."""
        roles.relink(self, get=lambda ar, what: _get(self, ar, self.init_kwargs["timeout_s"], what=what))
        return self

    def restart(self, *, timeout_s: float | None = None) -> "ClusterHandle":
        """Stop every engine, start n new ones and rebuild the world with the same ranks (a live controller needed)."""
        if lost := launch.controller_error(self.cluster):   # no engine could register: say so, not time out
            raise lost
        timeout_s = timeout_s or self.init_kwargs["timeout_s"]
        old_ranks, old_ids, watch = self.ranks, set(self.client.ids), Stopwatch()
        launch.kill_engines(self.cluster, self.client)   # survivors may sit in a collective until its timeout
        self.cluster.stop_engines_sync()
        launch.wait_until_unregistered(self.client, old_ids, timeout_s)
        watch.lap("stop_engines")
        self.cluster.start_engines_sync(self.n)
        watch.lap("engines_spawn")
        new_ids = launch.wait_for_new_engines(self.cluster, self.client, set(), self.n, timeout_s)
        watch.lap("register")
        _setup_world(self, new_ids, watch)
        if self.ranks != old_ranks:
            raise ClusterError(f"the launcher gave ranks {self.ranks} after restart, {old_ranks} before")
        return self

    def stop(self) -> None:
        """Stop engines and controller. The engines are SIGKILLed, as `restart()` does, without first leaving the
        process group: nothing is left to save, an engine with torch loaded takes 4-5 s to finish after SIGTERM
        (ipyparallel then SIGKILLs it anyway), and a graceful NCCL teardown of a notebook's world (megatron's
        groups, a model's memory) was most of a stop (bench/cluster_start.py --model; docs/benchmarks.md,
        notebooks, "`stop()` no longer leaves the process group")."""
        if self.view is None:   # already stopped
            return
        watch = Stopwatch()
        launch.kill_engines(self.cluster, self.client)
        watch.lap("kill_engines")
        launch.stop(self.cluster, self.client)
        watch.lap("stop_cluster")
        self.stop_s = dict(watch.phases, total=watch.total())
        self.view = None


def _setup_world(handle: ClusterHandle, engine_ids: list[int], watch: Stopwatch) -> None:
    """Ask engines who they are, assign ranks, rendezvous on rank 0's free port, init every engine."""
    client, kw = handle.client, handle.init_kwargs
    # a restart's old engines are gone: until the launcher's ranks are read, the new ones stand in engine-id order
    handle.rank_of = {e: i for i, e in enumerate(sorted(engine_ids))}
    idents = dict(zip(engine_ids, _get(handle, client[engine_ids].apply_async(on_engine.identity), kw["timeout_s"],
                                       what="asking the engines who they are")))
    ranks = roles.assign_ranks(idents)
    order, handle.rollout_ids = roles.split(ranks, handle.rollout_engines)   # trainers form the world
    handle.rank_of = {e: ranks[e][0] for e in order}
    handle.local_rank_of = {e: ranks[e][1] for e in order}
    handle.master_port = _get(handle, client[order[0]].apply_async(ports.reserve, kw["master_addr"]), kw["timeout_s"],
                              what="reserving rank 0's rendezvous port")   # held until init takes it
    handle.world_key, handle.abort_reason = watchdog.new_key(), None
    handle.idents = {handle.rank_of[e]: idents[e] for e in order}
    status_prefix = f"mfsdp_kit/status/{uuid.uuid4().hex}"
    pushed = [client[e].push(dict(rank=handle.rank_of[e], world_size=len(order), local_rank=handle.local_rank_of[e]),
                             block=False) for e in order]   # the names %%px cells use
    pending = [client[e].apply_async(on_engine.init, cfg=kw["cfg"], backend=kw["backend"], rank=handle.rank_of[e],
                                     world_size=len(order), local_rank=handle.local_rank_of[e],
                                     master_addr=kw["master_addr"], master_port=handle.master_port,
                                     abort_key=handle.world_key, status_prefix=status_prefix,
                                     log_dir=handle.log_dir) for e in order]
    handle.view = client[order]
    handle.view.block = True
    watchdog.guard_view(handle)
    watch.lap("identify")
    for ar in pushed:   # a push to a dead engine fails here, with its rank named
        _get(handle, ar, kw["timeout_s"], what="handing the engines their ranks")
    inits = [_get(handle, ar, kw["timeout_s"]) for ar in pending]
    watch.lap("world_init")
    handle.devices, handle.backend = [i["device"] for i in inits], inits[0]["backend"]
    handle.logs = {handle.rank_of[e]: i["log"] for e, i in zip(order, inits) if i["log"]}
    handle.monitor = stall.Monitor(addr=kw["master_addr"], port=handle.master_port, prefix=status_prefix,
                                   ranks=handle.ranks, idents=handle.idents, stall_s=handle.stall_s)
    if handle.rollout_ids:
        roles.start_rollouts(handle, ranks=ranks, idents=idents,
                             get=lambda ar, what: _get(handle, ar, kw["timeout_s"], what=what))
    _secure_connection_files(handle)
    interrupt.activate(handle)
    handle.startup_s = dict(watch.phases, total=watch.total())
    for phase in inits[0]["phases"]:   # the slowest rank's engine-side phases
        handle.startup_s[f"engine.{phase}"] = max(i["phases"][phase] for i in inits)


def _get(handle: ClusterHandle, ar: Any, timeout_s: float, *, what: str = "runtime.init") -> Any:
    """`ar`'s result within `timeout_s` (every step of forming the world is bounded: an engine that registered but
    never answers fails `start` instead of hanging it), a remote failure named by `what`."""
    try:
        return handle.wait(ar, timeout_s=timeout_s, what=what)
    except ipp.error.RemoteError as err:
        raise ClusterError(f"{what} failed on an engine: {err}") from err


def _secure_connection_files(handle: ClusterHandle) -> None:
    """Connection files carry the message-signing key: owner read/write only (0600)."""
    for path in handle.connection_files:
        if stat.S_IMODE(os.stat(path).st_mode) & 0o077:
            os.chmod(path, 0o600)


def start(n: int | None = None, *, backend: str = "auto", cfg: EngineConfig | None = None, ip: str = LOCALHOST,
          master_addr: str | None = None, timeout_s: float = 120.0, device_count: int | None = None,
          device: str = "auto", stall_s: float = stall.STALL_S, collective_timeout_s: int | None = None,
          cell_timeout_s: float | None = None, log_dir: str | None = None, rollout_engines: int = 0,
          **launcher: Any) -> ClusterHandle:
    """Start n engines (default: one per visible GPU, else 2) as one torch.distributed world.

    ip: address the controller binds to (127.0.0.1 unless you need other hosts to reach it).
    master_addr: rendezvous host; default `ip` for local engines, rank 0's hostname otherwise.
    timeout_s: seconds for the engines to register, and again for each step of forming the process group (not
      collectives): a stalled step fails with its name.
    device_count: GPUs on this machine (default: torch's count); more local engines than GPUs is an error.
    device: "auto" (one GPU per engine, else the CPU) | "cpu" (local engines that see no GPU, even on a GPU node:
      gloo and CPU tensors; n=2 on a machine with one GPU).
    stall_s: seconds a rank may stand still (in a collective, or frozen) while another has finished the cell
      before the cell names it, with its stack (stall.py); nothing is aborted for it.
    collective_timeout_s: seconds a collective waits for its peers before it fails (default: `cfg`'s
      `communication.collective_timeout_s`, 600).
    cell_timeout_s: opt-in: a cell running longer aborts the world (`reinit()` then builds a new one).
    log_dir: each engine's stdout and stderr also go to `<log_dir>/<cluster id>/rank<r>.log` (None: a new folder
      under the system's temporary folder; `handle.logs` and `handle.status()` name the files).
    rollout_engines: of the n engines, how many (the last ranks) stay out of the world as rollout processes, each
      linked to trainer rank 0 (`link`, `handle.rollout_view`; roles.py, `rl.decoupled`). 0: every engine trains.
    launcher: passed to `ipyparallel.Cluster` (engines="mpi" | "slurm" | "ssh", profile_dir=, config=, ...); the
      kit's defaults fill only what neither it nor the profile's ipcluster_config.py sets.
      engines="mpi" needs mpiexec and mpi4py; on OpenMPI the kit allows oversubscription and, as root only,
      running as root (launch.openmpi_env; docs/cluster.md says how to override).
    """
    watch = Stopwatch()
    launcher = launch.with_profile(launcher)   # the profile's ipcluster_config.py counts in every check below
    launch.check_start(n=n, backend=backend, timeout_s=timeout_s, device_count=device_count, device=device,
                       launcher=launcher, stall_s=stall_s, collective_timeout_s=collective_timeout_s,
                       cell_timeout_s=cell_timeout_s)   # fail here, not after engines have started
    if collective_timeout_s is not None:
        cfg = cfg or EngineConfig()
        cfg = dataclasses.replace(cfg, communication=dataclasses.replace(cfg.communication,
                                                                         collective_timeout_s=collective_timeout_s))
    local = launch.kind(launcher) == "local"
    if device == "cpu":
        device_count = 0
    elif device_count is None:
        device_count = gpus.visible()   # the driver's count: no torch yet
    n = n if n is not None else (device_count or 2)
    roles.check(n=n, rollout_engines=rollout_engines)
    if cfg is not None:   # a bad cfg fails here, not on every engine after launch (each re-checks on its device)
        cfg.validate(world_size=n - rollout_engines, on_gpu=bool(device_count) or not local)   # other hosts: unknown
    if local and device_count and n > device_count:
        raise ClusterConfigError(f"n={n} engines asked for, but this machine has {device_count} GPUs (one GPU per "
                                 f"engine); allowed: n <= {device_count}, device='cpu' for engines on the CPU, or "
                                 "engines='slurm' / 'mpi' to span nodes")
    watch.lap("checks")
    cluster = launch.make_cluster(n=n, ip=ip, timeout_s=timeout_s, launcher=launcher, see_gpus=device != "cpu")
    init_kwargs = dict(cfg=cfg, backend=backend, timeout_s=timeout_s, master_addr=master_addr or ip)
    client = None
    try:
        client = launch.start_processes(cluster, n, watch)
        _import_in_background("torch")   # what the notebook's next lines need, while the engines boot
        engine_ids = launch.wait_for_new_engines(cluster, client, set(), n, timeout_s)
        watch.lap("register")
        handle = ClusterHandle(cluster=cluster, client=client, n=n, init_kwargs=init_kwargs, stall_s=stall_s,
                               cell_timeout_s=cell_timeout_s, rollout_engines=rollout_engines,
                               log_dir=str(Path(log_dir or tempfile.mkdtemp(prefix="mfsdp_kit-logs-")).resolve()
                                           / cluster.cluster_id))
        if not local and master_addr is None:
            host = _get(handle, client[engine_ids].apply_async(on_engine.identity), timeout_s,
                        what="asking the engines who they are")
            init_kwargs["master_addr"] = _rank0_host(engine_ids, host)
        _setup_world(handle, engine_ids, watch)
        _started[:] = [h for h in _started if h.view is not None] + [handle]
        return handle
    except BaseException:
        launch.stop(cluster, client)
        raise


_started: list[ClusterHandle] = []


def status(handle: ClusterHandle | None = None) -> "status_view.Status":
    """`handle.status()`; without a handle, that of the world this notebook started last and has not stopped."""
    live = [h for h in _started if h.view is not None]
    if handle is None and not live:
        raise ClusterError("no running cluster: start one with cluster.start(), or pass handle=")
    return (handle or live[-1]).status()


def _import_in_background(module: str) -> None:
    """Import `module` in a daemon thread unless it is imported already. A notebook imports torch right after
    `start()` (its model, its plots): in the kernel that is 1-2 s on a GPU node, spent here while the engines boot
    instead of after. Python's per-module import locks make a main-thread import of it wait for this one."""
    if module not in sys.modules:
        threading.Thread(target=importlib.import_module, args=(module,), name=f"import-{module}", daemon=True).start()


def _rank0_host(engine_ids: list[int], idents: list[dict]) -> str:
    ranks = roles.assign_ranks(dict(zip(engine_ids, idents)))
    rank0 = next(e for e, (r, _) in ranks.items() if r == 0)
    return idents[engine_ids.index(rank0)]["host"]
