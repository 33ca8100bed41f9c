"""Process groups, megatron's parallel state and seeds: `init` once per process, `shutdown` to redo.

The same calls run under torchrun, in a pytest subprocess and on an ipyparallel engine.
Rank and world size come from arguments or from the usual env vars (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT). On a machine without CUDA the backend is gloo and
`compat.cpu` is enabled before megatron builds anything.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .config import EngineConfig

BACKENDS = ("auto", "nccl", "gloo")


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


def init(cfg: EngineConfig | None = None, *, backend: str = "auto", rank: int | None = None,
         world_size: int | None = None, local_rank: int | None = None, master_addr: str | None = None,
         master_port: int | None = None, timeout_s: float = 600.0) -> Runtime:
    """Start torch.distributed + megatron parallel state for `cfg`; idempotent for the same cfg."""
    global _current, _cfg
    cfg = cfg or EngineConfig()
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed; allowed: {' | '.join(BACKENDS)}")
    if _current is not None:
        if _cfg == cfg:
            return _current
        shutdown()  # new parallel layout over the same world
    rank = _env_int("RANK", 0) if rank is None else rank
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    local_rank = _env_int("LOCAL_RANK", rank) if local_rank is None else local_rank
    on_gpu = torch.cuda.is_available()
    cfg.validate(world_size=world_size, on_gpu=on_gpu)
    from .compat import no_te
    no_te.enable()
    backend = ("nccl" if on_gpu else "gloo") if backend == "auto" else backend
    if on_gpu:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        from .compat import cpu
        cpu.enable()
        device = torch.device("cpu")
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(f"world_size={world_size} but this process already belongs to a world of "
                             f"{dist.get_world_size()}; call shutdown(destroy_process_group=True) first")
    else:
        os.environ.setdefault("MASTER_ADDR", master_addr or "127.0.0.1")
        if master_port is not None:
            os.environ["MASTER_PORT"] = str(master_port)
        os.environ.setdefault("MASTER_PORT", "29500")
        timeout = timedelta(seconds=timeout_s)
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent hosts the store on MASTER_PORT
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        else:
            store = _store(addr=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]), rank=rank,
                           world_size=world_size, timeout=timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    _init_megatron(cfg)
    set_seed(cfg.seed)
    from megatron.core import parallel_state as ps
    _current = Runtime(rank=rank, world_size=world_size, local_rank=local_rank, backend=backend, device=device,
                       dp_size=ps.get_data_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                       pp_rank=ps.get_pipeline_model_parallel_rank())
    _cfg = cfg
    return _current


_listen_socket: socket.socket | None = None


def _store(*, addr: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous store, its server (rank 0) listening on `addr` only.

    torch's default TCPStore server listens on every interface, and the store has no
    authentication: bound to 127.0.0.1 (the default MASTER_ADDR) it is reachable from this
    machine alone. Rank 0 binds the socket itself and hands it to the store."""
    global _listen_socket
    if rank != 0:
        return dist.TCPStore(addr, port, world_size, False, timeout=timeout)
    _listen_socket = socket.create_server((addr, port), reuse_port=False)
    return dist.TCPStore(addr, port, world_size, True, timeout=timeout, master_listen_fd=_listen_socket.fileno())


def _init_megatron(cfg: EngineConfig) -> None:
    from megatron.core import parallel_state as ps
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
        context_parallel_size=cfg.context_parallel_size,
    )


def set_seed(seed: int) -> None:
    """Seed torch and megatron's RNG tracker (TP ranks get distinct model-parallel streams)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def current() -> Runtime:
    """The runtime of this process; a clear error if `init` has not run."""
    if _current is None:
        raise RuntimeError("mfsdp_kit.runtime.init() has not run in this process "
                           "(in a notebook: call cluster.start() first, then use %%px cells)")
    return _current


def current_config() -> EngineConfig:
    current()
    return _cfg


def shutdown(*, destroy_process_group: bool = False) -> None:
    """Tear down megatron's parallel state so `init` can run again in this process.

    The world process group stays by default: torch numbers new groups from 0 again after the
    default group is destroyed, and the rendezvous store still holds the old incarnation's keys
    under those names, so a second `init_process_group` in one process can connect to stale
    addresses. Keeping the world lets `init` build any new parallel layout over it. Pass
    `destroy_process_group=True` at the very end of a process.
    """
    global _current, _cfg
    from megatron.core import parallel_state as ps
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
    _current = _cfg = None
