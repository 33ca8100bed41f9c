"""Bytes on disk: torch DCP writes (sync and async), the safe DCP read, JSON files, fsync.

Every `dcp.load` of the kit is `read(state, path)`: DCP with `trust.SafeReader` (allow-list
unpickler for `.metadata`) and `trust.SafeLoadPlanner` (weights_only for non-tensor values).
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import torch

from .trust import SafeLoadPlanner, SafeReader


def read(state: dict, path) -> None:
    """torch DCP load of `state` (in place) from `path`, never unpickling code. Collective."""
    import torch.distributed.checkpoint as dcp
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())


def write(state: dict, path: Path, *, async_save: bool = False, process_group=None, thread_count: int = 1):
    """torch DCP save (collective); with `async_save` the future of DCP's background write.

    Async: `stage` has already copied `state` to host memory, so DCP's own stager would only copy
    it again (and its copy breaks on CPU tensors and on Megatron-FSDP's uneven shards); the
    background thread coordinates over `process_group` (gloo), never the training group.
    """
    import torch.distributed.checkpoint as dcp
    writer = dcp.FileSystemWriter(str(path), thread_count=thread_count)
    if async_save:
        return dcp.async_save(state, storage_writer=writer, process_group=process_group,
                              async_stager=Prestaged())
    dcp.save(state, storage_writer=writer)
    return None


class Prestaged:
    """A DCP AsyncStager for a state dict that is already a host copy: hands it over as is."""
    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def stage(state, pinned: dict, prefix: str = ""):
    """A host copy of `state` (nested dicts of tensors / DTensors) that training cannot change.

    Host buffers are pinned on CUDA and kept in `pinned` (by key) for the next save, so the copy
    is one device->host DMA per tensor. DTensors keep mesh, placements and Megatron-FSDP's
    uneven-shard metadata (attached to the local tensor), so the files are the same as a
    synchronous save's.
    """
    from torch.distributed.tensor import DTensor
    if isinstance(state, dict):
        return {k: stage(v, pinned, f"{prefix}{k}.") for k, v in state.items()}
    if not torch.is_tensor(state):
        return state
    # _local_tensor, not to_local(): with requires_grad that is an alias without the uneven metadata.
    local = state._local_tensor if isinstance(state, DTensor) else state
    key = prefix[:-1]
    buf = pinned.get(key)
    if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
        buf = torch.empty_like(local, device="cpu", pin_memory=local.is_cuda)
        pinned[key] = buf
    buf.copy_(local.detach(), non_blocking=local.is_cuda)
    if not isinstance(state, DTensor):
        return buf
    out = DTensor.from_local(buf, device_mesh=state.device_mesh, placements=state.placements,
                             run_check=False, shape=state.shape, stride=state.stride())
    for attr in ("__create_chunk_list__", "__create_write_items__"):
        if hasattr(local, attr):
            setattr(out._local_tensor, attr, getattr(local, attr))
    return out


def harden(path: Path) -> None:
    """Drop group/other write bits (so `check_trusted` accepts what we wrote). No fsync here: DCP's
    FileSystemWriter fsyncs each file it writes (sync_files=True) and `write_json` its own."""
    for p in path.iterdir():
        p.chmod(p.stat().st_mode & ~(stat.S_IWGRP | stat.S_IWOTH))
    path.chmod(path.stat().st_mode & ~(stat.S_IWGRP | stat.S_IWOTH))


def write_json(path: Path, obj) -> None:
    """`obj` as JSON at `path`, atomically (a `.tmp` sibling, fsync, rename; the `.tmp` goes on failure)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

