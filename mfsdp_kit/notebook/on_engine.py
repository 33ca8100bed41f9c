"""What `cluster.start` runs on each engine (pickled by reference, so importable there): who the engine is, joining
the world (and what a notebook engine adds to `runtime.init`: Stop as a pause, the watchdog, the heartbeat and its
log file), leaving it."""
from __future__ import annotations

import os
import socket
from typing import Any

from . import watchdog
from ..config import EngineConfig
from ..distributed.stopwatch import Stopwatch

RANK_ENV = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
"""Where MPI / Slurm launchers put an engine's global rank (first one set wins)."""
LOCAL_RANK_ENV = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
"""Where they put its rank within the node."""


def first_env_int(names: tuple[str, ...]) -> int | None:
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def identity() -> dict:
    """Who this engine is: pid, host and the ranks its launcher gave it (None when it gave none)."""
    return dict(pid=os.getpid(), host=socket.gethostname(),
                env_rank=first_env_int(RANK_ENV), env_local_rank=first_env_int(LOCAL_RANK_ENV))


def init(*, cfg: EngineConfig | None, backend: str, rank: int, world_size: int, local_rank: int,
                 master_addr: str, master_port: int, abort_key: str = "", status_prefix: str = "",
                 log_dir: str | None = None) -> dict:
    """Join the world: one GPU per engine, env vars as torchrun sets them, `runtime.init`; then Stop as a pause
    (`distributed.stop`), the watchdog, and the heartbeat (under `status_prefix`, output teed into `log_dir`).

    Returns device, backend, the log file and seconds per phase (the imports are timed apart: they dominate on CPU).
    """
    watch = Stopwatch()
    from mfsdp_kit.notebook import ipengine
    ipengine.wait()   # the imports begun at engine boot (python -m mfsdp_kit.notebook.ipengine)
    watch.lap("preload_wait")
    from mfsdp_kit import compat
    compat.apply("startup")   # before megatron's import (compat/patches/startup.py); a no-op after ipengine's
    import torch
    watch.lap("import_torch")
    import megatron.core.parallel_state  # noqa: F401  (runtime.init needs it; timed on its own)
    from mfsdp_kit.distributed import runtime
    watch.lap("import_megatron")
    if torch.cuda.is_available():   # local_rank >= GPUs on this node fails here, not silently shared
        torch.cuda.set_device(local_rank)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    rt = runtime.init(cfg, backend=backend, rank=rank, world_size=world_size, local_rank=local_rank,
                      master_addr=master_addr, master_port=master_port)
    watch.lap("runtime_init")
    if abort_key:   # watchdog.py: the client aborts every rank's groups when one rank fails
        watchdog.arm(master_addr, master_port, abort_key)
    from mfsdp_kit.notebook import progress
    from mfsdp_kit.distributed import progress as loop_progress
    loop_progress.listen(progress.publish)   # the loops' reports reach this notebook's bars and panels
    log = _stop_and_heartbeat(addr=master_addr, port=master_port, prefix=status_prefix, rank=rank, log_dir=log_dir)
    return dict(device=f"{rt.device}", backend=rt.backend, log=log, phases=watch.phases)


def _stop_and_heartbeat(*, addr: str, port: int, prefix: str, rank: int, log_dir: str | None) -> str | None:
    """Stop as a pause (`distributed.stop`; collective in a world: every rank here at once), cleared at each new
    cell, and the heartbeat under `prefix` in the store at addr:port (none without a prefix); returns the log."""
    from mfsdp_kit.distributed import stop
    from mfsdp_kit.notebook import heartbeat
    stop.enable()
    _clear_stop_at_each_cell()
    return heartbeat.start(addr=addr, port=port, prefix=prefix, rank=rank, log_dir=log_dir) if prefix else None


def _clear_stop(_info: Any = None) -> None:
    from mfsdp_kit.distributed import stop
    stop.clear()


def _clear_stop_at_each_cell() -> None:
    """A Stop left pending by the last cell (it came as the cell ended) must not stop the next cell's loop."""
    from IPython import get_ipython
    shell = get_ipython()
    if shell is not None and _clear_stop not in shell.events.callbacks["pre_run_cell"]:
        shell.events.register("pre_run_cell", _clear_stop)


def shutdown() -> None:
    """Leave the world (`reinit` builds the next one): its Stop group goes with it."""
    from mfsdp_kit.distributed import runtime, stop
    stop.disable()
    runtime.shutdown(destroy_process_group=True)


def init_rollout(*, local_rank: int, rank: int, status_addr: str, status_port: int, status_prefix: str,
                 log_dir: str | None) -> dict:
    """A rollout engine (`roles.py`): no world; its GPU (`local_rank`, as a trainer's), Stop as a pause of its own
    loop (`rl.decoupled.serve` asks `stop.agreed()`, which without a world is this engine's flag), and a heartbeat
    under its launcher `rank` in the world's store, so `handle.status()` shows it beside the trainers."""
    from mfsdp_kit import compat
    from mfsdp_kit.notebook import ipengine
    ipengine.wait()
    compat.apply("startup")   # before megatron's import (the link's push imports it), as `init` does
    import torch
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    log = _stop_and_heartbeat(addr=status_addr, port=status_port, prefix=status_prefix, rank=rank, log_dir=log_dir)
    return dict(device=f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu", log=log)


def join_link(*, host: str, port: int, rank: int, size: int, backend: str) -> int:
    """Join the trainer -> rollout link (`weights.push.connect`; rank 0 takes the port `ports.reserve` holds here)
    and keep it as `link` in this engine's namespace, for the cells."""
    from IPython import get_ipython
    from mfsdp_kit.weights import push
    names = get_ipython().user_ns
    if isinstance(old := names.get("link"), push.Link):   # its watcher thread ends, its store with it
        push.close(old, reason="replaced by handle.relink()")
    names["link"] = push.connect(host=host, port=port, rank=rank, size=size, backend=backend)
    return rank
