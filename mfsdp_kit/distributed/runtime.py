"""Process groups, megatron's parallel state and seeds: `init` once per process, `shutdown` to redo.

The same calls run under torchrun, in a pytest subprocess and on an ipyparallel engine.
Rank and world size come from arguments or from the usual env vars (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT). On a machine without CUDA the backend is gloo and
`compat.patches.cpu` is enabled before megatron builds anything.
"""
from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import socket
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import compat
from ..config import BACKENDS, ConfigError, EngineConfig, bad_value  # noqa: F401  (ConfigError: what init raises)
from ..config.sections import Communication
from ..fieldtypes import is_int
from ..config.parallel_dims import ParallelDims
from . import ports


@dataclass(frozen=True)
class Runtime:
    """What this process is in the job."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    dp_size: int
    """Data-parallel ranks (world / (tp * pp * cp))."""
    tp_rank: int
    pp_rank: int


_current: Runtime | None = None
_cfg: EngineConfig | None = None


def _env_int(name: str, default: int | None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"{name} is not set: pass it to init() or export it (torchrun does)")
        return default
    return int(value)


def _check_world(*, backend: str, rank: int, world_size: int, local_rank: int, timeout_s: float) -> None:
    """The launch arguments, checked like config fields: a bad one is a `ConfigError` before any socket opens."""
    if backend not in BACKENDS:
        raise bad_value("backend", backend, " | ".join(BACKENDS))
    if not is_int(world_size) or world_size < 1:
        raise bad_value("world_size", world_size, "an integer >= 1")
    if not is_int(rank) or not 0 <= rank < world_size:
        raise bad_value("rank", rank, f"an integer in [0, {world_size - 1}] (world_size={world_size})")
    if not is_int(local_rank) or local_rank < 0:
        raise bad_value("local_rank", local_rank, "an integer >= 0")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise bad_value("timeout_s", timeout_s, "a finite number of seconds > 0")


def init(cfg: EngineConfig | None = None, *, backend: str = "auto", rank: int | None = None,
         world_size: int | None = None, local_rank: int | None = None, master_addr: str | None = None,
         master_port: int | None = None, timeout_s: float = 600.0) -> Runtime:
    """Start torch.distributed + megatron parallel state for `cfg`; idempotent for the same cfg."""
    global _current, _cfg
    compat.apply("startup")   # before megatron's import below: its process-wide compat rows (compat/patches/startup.py)
    cfg = cfg or EngineConfig()
    if _current is not None:
        if _cfg == cfg:
            return _current
        shutdown()  # new parallel layout over the same world
    rank = _env_int("RANK", 0) if rank is None else rank
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    local_rank = _env_int("LOCAL_RANK", rank) if local_rank is None else local_rank
    _check_world(backend=backend, rank=rank, world_size=world_size, local_rank=local_rank, timeout_s=timeout_s)
    on_gpu = torch.cuda.is_available()
    cfg.validate(world_size=world_size, on_gpu=on_gpu)
    compat.apply("no_te")
    compat.apply("fsdp_grads")   # one-rank FSDP groups (expert-data-parallel size 1) would get 2x gradients
    compat.apply("grad_norm")    # without TE/Apex, megatron's grad norm syncs with the GPU once per tensor
    compat.apply("grad_norm_on_device")   # and once more for the norm itself and the clip test: none left
    backend = ("nccl" if on_gpu else "gloo") if backend == "auto" else backend
    if on_gpu:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        compat.apply("cpu")
        device = torch.device("cpu")
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise bad_value("world_size", world_size, f"{dist.get_world_size()}, the world this process already belongs "
                                                 "to; call shutdown(destroy_process_group=True) first")
    else:
        os.environ.setdefault("MASTER_ADDR", master_addr or "127.0.0.1")
        if master_port is not None:
            os.environ["MASTER_PORT"] = str(master_port)
        os.environ.setdefault("MASTER_PORT", "29500")
        sockets_on_loopback_if_master_is(os.environ["MASTER_ADDR"])
        agent = master_port is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's
        store = _rendezvous(addr=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s), agent=agent)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=cfg.communication.collective_timeout_s))
    _init_megatron(cfg, cfg.parallel_dims(world_size))
    set_seed(cfg.seed)
    from megatron.core import parallel_state as ps
    _current = Runtime(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend, device=device,
                       dp_size=ps.get_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                       pp_rank=ps.get_pipeline_model_parallel_rank())
    _cfg = cfg
    return _current


# ---- rendezvous ------------------------------------------------------------------------------
_tcp_store: tuple[tuple, dist.TCPStore] | None = None
"""((addr, port, rank, world_size, agent), the TCPStore): one per process, kept across init/shutdown cycles."""
_incarnation = 0
"""Process groups this process has created through `init`; every rank counts the same."""


def _rendezvous(*, addr: str, port: int, rank: int, world_size: int, timeout: timedelta, agent: bool) -> dist.Store:
    """The store for this incarnation of the world: the process's one TCPStore under a fresh key prefix.

    The naive version builds a TCPStore per `init`. Rebinding the same port then fails while the
    old store lives (EADDRINUSE), and a store that does outlive a world hands the next one stale
    keys: torch numbers process groups from 0 again after `destroy_process_group`, so the new
    world's gloo rendezvous would read the old world's addresses. So the store lives as long as
    the process (or until addr/port/world change) and each world gets its own key prefix
    `mfsdp_kit/<torchrun restart>/<n>/`; every rank runs the same init/shutdown sequence, so they
    agree on n."""
    global _tcp_store, _incarnation
    key = (addr, port, rank, world_size, agent)
    if _tcp_store is None or _tcp_store[0] != key:
        _tcp_store = None   # drop the old one first: rank 0's server closes its socket, freeing the port
        store = new_tcp_store(addr=addr, port=port, rank=rank, world_size=world_size, timeout=timeout, agent=agent)
        _tcp_store = (key, store)
    _tcp_store[1].set_timeout(timeout)
    _incarnation += 1
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")   # torchrun's agent store outlives its workers
    return dist.PrefixStore(f"mfsdp_kit/{restart}/{_incarnation}/", _tcp_store[1])


def new_tcp_store(*, addr: str, port: int, rank: int, world_size: int, timeout: timedelta,
                   agent: bool) -> dist.TCPStore:
    """A client of torchrun's agent store, or (elsewhere) rank 0's server listening on `addr` only.

    torch's default TCPStore server listens on every interface, and the store has no
    authentication: bound to 127.0.0.1 (the default MASTER_ADDR) it is reachable from this
    machine alone. Rank 0 binds the socket itself and hands it over with `detach()`: the store
    owns the descriptor and closes it when it dies. (Passing `fileno()` and keeping the Python
    socket closes the same descriptor twice -- the second time it may already belong to a
    gloo pair or the next store.)"""
    if rank != 0 or agent:
        return dist.TCPStore(addr, port, world_size, False, timeout=timeout)
    sock = ports.take(addr, port) or socket.create_server((addr, port), family=ports.family(addr),
                                                         reuse_port=False)   # ports.py: no race
    return dist.TCPStore(addr, port, world_size, True, timeout=timeout, master_listen_fd=sock.detach())


def sockets_on_loopback_if_master_is(master_addr: str) -> None:
    """With a loopback MASTER_ADDR, make gloo (and NCCL's bootstrap) listen on loopback too.

    gloo does not use MASTER_ADDR for its own listening sockets: without GLOO_SOCKET_IFNAME it
    binds to the address the hostname resolves to -- on most hosts the LAN address, so a
    "local" world would accept connections from the network. A world whose rendezvous is on
    127.0.0.1 is one machine by construction, so loopback loses nothing. A value the user set wins."""
    if not is_loopback(master_addr) or (name := loopback_interface()) is None:
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:   # a host name: loopback when every address it resolves to is
        try:
            infos = socket.getaddrinfo(addr, None)
        except OSError:
            return False
        return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def loopback_interface() -> str | None:
    """The name of the interface holding 127.0.0.1 ("lo" on Linux, "lo0" on macOS), None if none does."""
    import psutil
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs):
            return name
    return None


def _init_megatron(cfg: EngineConfig, dims: ParallelDims) -> None:
    from megatron.core import parallel_state as ps
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    comm = cfg.communication
    with _nccl_config_file(comm) as nccl_config:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
            virtual_pipeline_model_parallel_size=cfg.parallelism.virtual_pipeline_model_parallel_size,
            context_parallel_size=dims.cp,
            expert_model_parallel_size=dims.ep,   # expert TP = TP (megatron's default)
            num_distributed_optimizer_instances=dims.dp_replicate,   # > 1: HSDP's groups (hsdp.py)
            create_all_gather_group=cfg.wrapper.use_megatron_fsdp and comm.fsdp_all_gather_group,
            high_priority_stream_groups=["dp_cp"] if comm.high_priority_comm else None,
            nccl_communicator_config_path=nccl_config,
            distributed_timeout_minutes=comm.collective_timeout_s / 60,
        )


@contextlib.contextmanager
def _nccl_config_file(comm: Communication):
    """megatron reads per-communicator NCCL options from a YAML file only: write one for `comm.nccl_max_ctas` (the
    data-parallel groups, which Megatron-FSDP's gathers and reduce-scatters and DDP's reductions use), else None."""
    if comm.nccl_max_ctas is None:
        yield None
        return
    import yaml
    with tempfile.TemporaryDirectory(prefix="mfsdp_nccl_") as tmp:
        path = os.path.join(tmp, "nccl.yaml")
        with open(path, "w") as f:
            yaml.safe_dump({group: {"max_ctas": comm.nccl_max_ctas} for group in ("dp_cp", "dp")}, f)
        yield path


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device`. A host tensor bound for a GPU goes through pinned memory without blocking: a copy from
    pageable memory waits for everything queued on the stream (a host sync every step)."""
    pin = torch.device(device).type == "cuda" and not t.is_cuda
    return t.pin_memory().to(device, non_blocking=True) if pin else t.to(device)


def set_seed(seed: int) -> None:
    """Seed torch and megatron's RNG tracker (TP ranks get distinct model-parallel streams)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def is_initialized() -> bool:
    """Has `init` run in this process (and `shutdown` not undone it)?"""
    return _current is not None


def current() -> Runtime:
    """The runtime of this process; a clear error if `init` has not run."""
    if _current is None:
        raise RuntimeError("mfsdp_kit.distributed.runtime.init() has not run in this process "
                           "(in a notebook: call cluster.start() first, then use %%px cells)")
    return _current


def barrier() -> None:
    """Every rank of the world waits for the others; nothing without a process group. On NCCL the barrier is told
    this rank's GPU (`device_ids`): torch would otherwise take the current context's and warn that it did."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def broadcast(obj):
    """Rank 0's `obj` on every rank (pickled); `obj` itself without a process group."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def current_config() -> EngineConfig:
    current()
    return _cfg


def shutdown(*, destroy_process_group: bool = False) -> None:
    """Tear down megatron's parallel state so `init` can run again in this process.

    The world process group stays by default, so `init` can build any new parallel layout over it
    without a new rendezvous. `destroy_process_group=True` leaves the world (the end of a process,
    or before joining another); a later `init` in this process rendezvouses again, under a fresh
    key prefix of the same store (see `_rendezvous`).
    """
    global _current, _cfg
    from megatron.core import parallel_state as ps
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
    _current = _cfg = None
