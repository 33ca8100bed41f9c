"""Bytes on disk: torch DCP writes (sync and async), the safe DCP read, JSON files, fsync.

Every `dcp.load` of the kit is `read(state, path)`: DCP with `trust.SafeReader` (allow-list
unpickler for `.metadata`) and `trust.SafeLoadPlanner` (weights_only for non-tensor values),
its files read by `read_threads` threads (DCP's FileSystemReader reads them one after another),
tensor items in every format (`rawread`). It checks no crc32: a load verifies every file before it
(`restore.load_dir`), as DCP reads into the live tensors.

Every `dcp.save` is `write(...)`: DCP's FileSystemWriter, whose `thread_count` threads each
write a share of the tensors into their own file, each as the torch.save archive stock torch reads,
written around the tensor's memory (`rawio`, `torchsave`; tensor_format "raw": the bytes alone, which
only the kit reads; "torch_save": DCP's own torch.save per item, the format before both). The naive integrity check reads those files
back after the save to crc32 them - a second pass over every byte, started only when the last
writer is done. Here each writer thread's stream crc32s the bytes on their way to the file, in
PIECE_BYTES pieces (the piece is still in the CPU cache when it is written), and fsyncs the file
itself (`HashingFileSystem`). The checksum is then the one of the bytes the kit meant to write,
so a file damaged on its way to the disk fails at load, not silently at save. torch.save's own
per-record crc32 (zip format; `torch.load` re-checks it) is switched off while the kit writes:
it hashed every byte a second time at save and at load, and the file crc32 covers the same bytes.
"""
from __future__ import annotations

import json
import os
import stat
import threading
import time
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from . import integrity, rawio, rawread
from .rawio import PIECE_BYTES
from .trust import SafeLoadPlanner, SafeReader


def read(state: dict, path, *, threads: int = 4, phases: dict | None = None, files=None) -> None:
    """torch DCP load of `state` (in place) from `path`, never unpickling code. Collective.
    Checks no checksum: verify the files first (`integrity.verify`), DCP reads into `state`'s own tensors.
    `phases` (a dict) gets this rank's seconds of plan (DCP's planning and its collectives), data
    (`read_data`: the reader threads), finish (DCP's last barrier) and, per file (mean over files),
    file_read, copy (into the destination: host->device on GPU), other (the rest of a reader thread's
    time), slowest_file. `files` (meta.json's list): every storage path in the metadata DCP reads must
    be one of them."""
    import torch.distributed.checkpoint as dcp
    reader = ParallelReader(str(path), threads=threads, files=files)
    start = time.perf_counter()
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner())
    done = time.perf_counter()
    if phases is not None:
        marks = reader.marks
        phases.update(plan=marks.get("data", done) - start, data=marks.get("data_done", done) - marks.get("data", done),
                      finish=done - marks.get("data_done", done))
        phases.update(reader.file_s)


def write(state: dict, path: Path, *, async_save: bool = False, process_group=None, thread_count: int = 1,
          fs: "HashingFileSystem | None" = None, tensor_format: str = "standard"):
    """torch DCP save (collective); with `async_save` the future of DCP's background write.

    `fs` (a HashingFileSystem) records each written file's size and crc32 and the writer threads'
    seconds. Async: `stage` has already copied `state` to host memory, so DCP's own stager would
    only copy it again (and its copy breaks on CPU tensors and on Megatron-FSDP's uneven shards);
    the background thread coordinates over `process_group` (gloo), never the training group.
    `tensor_format`: "standard" (torch.save archives around each tensor's memory: `rawio`, `torchsave`),
    "raw" (the bytes alone, RAW-marked: only the kit reads them) or "torch_save" (DCP's torch.save per item).
    """
    import torch.distributed.checkpoint as dcp
    writer = HashingWriter(str(path), thread_count=thread_count, fs=fs or HashingFileSystem(),
                          tensor_format=tensor_format)
    if async_save:
        future = dcp.async_save(state, storage_writer=writer, process_group=process_group,
                                async_stager=Prestaged())
        future.add_done_callback(lambda _: writer.fs.marks.setdefault("done", time.perf_counter()))
        return future
    dcp.save(state, storage_writer=writer)
    writer.fs.marks["done"] = time.perf_counter()
    return None


class HashingStream:
    """A file opened for writing that crc32s and counts what passes through `write`."""

    def __init__(self, file, times: dict):
        self.file, self.times, self.crc, self.nbytes = file, times, 0, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, view.nbytes, PIECE_BYTES):
            piece = view[i:i + PIECE_BYTES]
            t0 = time.perf_counter()
            self.crc = zlib.crc32(piece, self.crc)
            t1 = time.perf_counter()
            self.file.write(piece)
            self.times["checksum"] += t1 - t0
            self.times["file_write"] += time.perf_counter() - t1
        self.nbytes += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.nbytes

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.file.fileno()

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        """Flush and fsync (DCP's own fsync is off: `HashingWriter` passes sync_files=False)."""
        if self.file.closed:
            return
        t0 = time.perf_counter()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.times["fsync"] += time.perf_counter() - t0
        self.file.close()


PER_FILE = ("serialise", "checksum", "file_write", "fsync")
"""The per-file means among the save's phases (`write_phases`): writer-thread seconds, not a lap of the save."""


class HashingFileSystem(FileSystem):
    """DCP's FileSystem whose write streams are `HashingStream`s.

    `sums`: {file name: {"bytes", "crc32"}} of the files written (integrity's format);
    `thread_s`: writer-thread seconds summed over threads - checksum, file_write (copies into the
    page cache), fsync, serialise (the rest: torch.save's headers, DCP, device->host copies);
    `slowest_s`: wall seconds of the slowest file (the writer threads' part of the save);
    `marks`: perf_counter() seconds when this rank's `write_data` began (data) and ended
    (data_done), and when DCP's save returned (done: after its result gather and `.metadata`).
    """

    def __init__(self):
        super().__init__()
        self.sums: dict = {}
        self.thread_s = dict.fromkeys(PER_FILE, 0.0)
        self.slowest_s, self.marks = 0.0, {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        if not str(path).endswith(".distcp"):  # .metadata(.tmp): rank 0, in DCP's finish
            with create_new(path) as stream:
                yield stream
            return
        start, times = time.perf_counter(), dict.fromkeys(("checksum", "file_write", "fsync"), 0.0)
        with create_new(path) as file:
            stream = HashingStream(file, times)
            yield stream
            stream.close()
        with self._lock:
            self.sums[Path(path).name] = {"bytes": stream.nbytes, "crc32": f"{stream.crc:08x}"}
            wall = time.perf_counter() - start
            for k, v in times.items():
                self.thread_s[k] += v
            self.thread_s["serialise"] += wall - sum(times.values())
            self.slowest_s = max(self.slowest_s, wall)

    def write_phases(self, write_start: float, written: float) -> dict:
        """The write phase's parts on this rank, in seconds, from perf_counter() `write_start` to
        `written`: plan (DCP's planning and its collectives; async: also the wait for the background
        thread), data (`write_data`: the writer threads), finish (DCP's result gather; rank 0 writes
        `.metadata`), rest; per file (mean): serialise, checksum, file_write, fsync; slowest_file."""
        data, data_done, done = (self.marks.get(k, written) for k in ("data", "data_done", "done"))
        out = {"write.plan": data - write_start, "write.data": data_done - data, "write.finish": done - data_done,
               "write.rest": written - done, "write.slowest_file": self.slowest_s}
        out.update({k: v / max(1, len(self.sums)) for k, v in self.thread_s.items()})
        return out


class HashingWriter(torch.distributed.checkpoint.FileSystemWriter):
    """DCP's FileSystemWriter on a `HashingFileSystem`, torch.save's per-record crc32 off.

    sync_files=False only because the streams fsync themselves (`HashingStream.close`); the
    `.metadata` DCP writes in `finish` is fsynced by the commit (manager._commit).
    """

    def __init__(self, path: str, *, thread_count: int, fs: HashingFileSystem, tensor_format: str = "standard"):
        super().__init__(path, thread_count=thread_count, sync_files=False)
        self.fs = fs
        # "raw" marks its items with a transform descriptor, which torch < 2.7 lacks: torch_save there
        self.tensor_format = "torch_save" if tensor_format == "raw" and not rawio.supported() else tensor_format

    def write_data(self, plan, planner):
        self.fs.marks["data"] = time.perf_counter()
        try:
            return self._write_items(plan, planner)
        finally:
            self.fs.marks["data_done"] = time.perf_counter()

    def _write_items(self, plan, planner):
        if self.tensor_format != "torch_save":
            return rawio.write_data(self, plan, planner, raw=self.tensor_format == "raw")
        # Process-wide while the shards are written (a torch.save elsewhere meanwhile records no
        # per-record crc32 either; torch.load reads such files). torch < 2.6 lacks the switch.
        if not hasattr(torch.serialization, "set_crc32_options"):
            return super().write_data(plan, planner)
        before = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            return super().write_data(plan, planner)
        finally:
            torch.serialization.set_crc32_options(before)


class ParallelReader(SafeReader):
    """SafeReader reading its files in `threads` threads (DCP's reader: one file after another),
    every tensor-item format (`rawread.read_data`)."""

    def __init__(self, path: str, *, threads: int = 4, files=None):
        super().__init__(path)
        self.threads, self.chunks, self.files = threads, {}, files
        self.marks: dict = {}
        """perf_counter() seconds when `read_data` began (data) and ended (data_done)."""
        self.file_s: dict = {}
        """Reader-thread seconds per file (mean over files), and the slowest file's wall seconds."""

    def read_metadata(self, *args, **kwargs):
        """The metadata DCP reads by (a second unpickle of `.metadata`), its storage paths checked again."""
        metadata = super().read_metadata(*args, **kwargs)
        if self.files is not None:
            integrity.check_storage(self.path, metadata, self.files)
        return metadata

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.chunks = rawread.chunk_table(metadata)

    def read_data(self, plan, planner):
        self.marks["data"] = time.perf_counter()
        try:
            return rawread.read_data(self, plan, planner)
        finally:
            self.marks["data_done"] = time.perf_counter()


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
    """Drop group/other write bits (so `check_trusted` accepts what we wrote). No fsync here: the
    writer streams fsync each shard file, the commit `.metadata`, and `write_json` its own."""
    for p in path.iterdir():
        if not p.is_symlink():   # none is ours; a link's chmod would change what it points to
            p.chmod(p.stat().st_mode & ~(stat.S_IWGRP | stat.S_IWOTH))
    path.chmod(path.stat().st_mode & ~(stat.S_IWGRP | stat.S_IWOTH))


def create_new(path, mode: int = 0o644):
    """`path` opened for binary writing only if nothing - no file, no symlink - is there yet (O_EXCL, and
    O_NOFOLLOW: a link planted under that name is never followed, the open fails with FileExistsError)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    return os.fdopen(os.open(path, flags, mode), "wb")


def write_json(path: Path, obj) -> None:
    """`obj` as JSON at `path`, atomically (a new `.tmp` sibling, fsync, rename; the `.tmp` goes on failure)."""
    tmp = path.with_name(path.name + ".tmp")
    f = create_new(tmp)   # fails while anything else is there: only what this call created is removed below
    try:
        with f:
            f.write(json.dumps(obj, indent=1, sort_keys=True).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

