"""The kit's reader of DCP shard files (`rawio` has the format and the writer): straight into the tensors' memory.

The naive reader: per item, read the slice, `torch.load` it into a new tensor, copy that into the
destination; and the checksums are a separate read of every file before it. Here each file is read
once, in offset order, one thread per file: an item whose first bytes are the archive head the kit
writes for its chunk (raw items: none) has its data next (any other, DCP's own: torch.load); that data
is `readinto` the destination's memory when it is a contiguous CPU tensor of the saved chunk (the same
layout), unless that read is hashed and another item fills the same memory too (`shared_destinations`);
a GPU or such a shared destination gets it through a per-thread buffer; anything else (another layout:
a part of the chunk) through a buffer and DCP's narrow + copy.

Verify while reading: the coordinator, which sees every rank's read plan (`assign_checks`), gives each
shard file to one rank - the one reading most of it (a file nobody reads: rank i % world) - and that
rank crc32s the whole file as it reads it (the bytes between its items too), then compares with
meta.json. So the bytes are read once, but a damaged file is found after (some of) its bytes were
copied into the state: the load then raises CheckpointCorruptError on every rank before any
component's `load_state_dict` runs.
"""
from __future__ import annotations

import dataclasses
import io
import math
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from . import integrity, rawio, torchsave
from .errors import CheckpointCorruptError, CheckpointError
from .rawio import PIECE_BYTES, RAW, STAGE_BYTES, byte_view


def chunk_table(metadata) -> dict:
    """{(fqn, chunk offsets): (chunk sizes, dtype)} of every saved tensor chunk."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    return {(fqn, tuple(c.offsets)): (tuple(c.sizes), md.properties.dtype)
            for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
            for c in md.chunks}


def assign_checks(plans: list, storage_data: dict, names) -> list:
    """Coordinator: each shard file in `names` goes to the rank reading most of its bytes (nobody:
    rank i % world); every plan's `storage_data` becomes the list of files that rank verifies."""
    read = [{} for _ in plans]
    for r, plan in enumerate(plans):
        seen = set()
        for item in plan.items:
            info = storage_data[item.storage_index]
            if (info.relative_path, info.offset) not in seen:
                seen.add((info.relative_path, info.offset))
                read[r][info.relative_path] = read[r].get(info.relative_path, 0) + info.length
    mine = [[] for _ in plans]
    for i, name in enumerate(sorted(names)):
        mine[max(range(len(plans)), key=lambda r: (read[r].get(name, 0), r == i % len(plans)))].append(name)
    return [dataclasses.replace(p, storage_data=files) for p, files in zip(plans, mine)]


def shared_destinations(items, planner) -> set:
    """Storage indices of the tensor items whose destination memory another item of `items` fills too.

    Megatron's distributed optimizer keeps an fp32 weight's main-param shard as a view of the weight,
    so `optimizer...param` and the model's `...weight` land in the same bytes, read by two reader
    threads. Read straight into that memory, a file's crc32 could hash what the other thread wrote
    there between this thread's read and its hash (intact bytes over damaged ones: damage unseen).
    These items go through a private buffer: the hash covers exactly the bytes read."""
    from torch.distributed.checkpoint.planner import LoadItemType
    spans = []
    for req in items:
        if req.type != LoadItemType.TENSOR:
            continue
        t = planner.resolve_tensor(req).detach()
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
        extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        spans.append((start, start + extent * t.element_size(), req.storage_index))
    shared, reach, reacher = set(), -1, None
    for start, end, index in sorted(spans, key=lambda s: (s[0], s[1])):
        if start < reach:   # overlaps the item reaching furthest so far
            shared.update((index, reacher))
        if end > reach:
            reach, reacher = end, index
    return shared


class _Crc:
    """A running crc32 that counts its bytes and its seconds (into `times["checksum"]`)."""

    def __init__(self, times: dict):
        self.value, self.nbytes, self.times = 0, 0, times

    def update(self, view) -> None:
        t0 = time.perf_counter()
        self.value = zlib.crc32(view, self.value)
        self.nbytes += len(view)
        self.times["checksum"] += time.perf_counter() - t0


def read_into(f, view: memoryview, crc: _Crc | None, path, times: dict) -> None:
    """Fill `view` from `f` (PIECE_BYTES at a time, each crc32'd while in cache); the read's
    seconds go to `times["file_read"]`."""
    for i in range(0, len(view), PIECE_BYTES):
        piece = view[i:i + PIECE_BYTES]
        got, t0 = 0, time.perf_counter()
        while got < len(piece):
            n = f.readinto(piece[got:])
            if not n:
                raise CheckpointCorruptError(f"{path} ends at byte {f.tell()}: an item needs more; the file is truncated")
            got += n
        times["file_read"] += time.perf_counter() - t0
        if crc is not None:
            crc.update(piece)


class FileReader:
    """Reads one shard file's items for `reader` (a `storage.ParallelReader`) in offset order."""

    def __init__(self, reader, name: str, items: list, planner, expected: dict | None, shared: frozenset = frozenset()):
        self.reader, self.planner, self.expected, self.shared = reader, planner, expected, shared
        self.path = reader.fs.concat_path(reader.path, name)
        self.items, self.pinned, self.loaded_bytes, self.scratch = items, rawio.Pinned(), [], None
        self.times = dict.fromkeys(("file_read", "checksum", "copy"), 0.0)
        """Seconds of this file's reads, crc32 and copies into the destinations; `wall` all of them."""
        self.wall = 0.0

    def run(self) -> list:
        """Read every item (hashing the whole file when `expected`); [(read item, bytes)] of byte items."""
        start, groups = time.perf_counter(), {}
        for req in self.items:
            info = self.reader.storage_data[req.storage_index]
            groups.setdefault((info.offset, info.length), (info, []))[1].append(req)
        crc, pos = (_Crc(self.times) if self.expected else None), 0
        try:
            with open(self.path, "rb", buffering=0) as f:
                for (offset, length), (info, reqs) in sorted(groups.items(), key=lambda kv: kv[0]):
                    if crc is not None and offset >= pos:
                        self.skip(f, offset - pos, crc)
                    else:  # not verifying here; or items overlap: then `check` hashes the file on its own
                        crc = None
                        f.seek(offset)
                    self.read_item(f, info, reqs, crc)
                    pos = offset + length
                if crc is not None:
                    self.skip(f, None, crc)
        except CheckpointCorruptError:
            raise
        except Exception as e:  # damaged bytes read by a rank that does not verify this file?
            self.check_whole_file(e)
            raise
        if self.expected:
            self.check(crc.value if crc is not None else None)
        self.wall = time.perf_counter() - start
        return self.loaded_bytes

    def skip(self, f, nbytes: int | None, crc: _Crc) -> None:
        """Hash the next `nbytes` (None: up to the end of the file) without keeping them."""
        if nbytes == 0:
            return
        if self.scratch is None:
            self.scratch = memoryview(bytearray(PIECE_BYTES))
        view = self.scratch
        while nbytes is None or nbytes > 0:
            t0 = time.perf_counter()
            n = f.readinto(view if nbytes is None else view[:min(PIECE_BYTES, nbytes)])
            self.times["file_read"] += time.perf_counter() - t0
            if not n:
                if nbytes:
                    raise CheckpointCorruptError(f"{self.path} ends at byte {f.tell()}: the file is truncated")
                return
            crc.update(view[:n])
            nbytes = None if nbytes is None else nbytes - n

    def read_item(self, f, info, reqs: list, crc: _Crc | None) -> None:
        """One item, `info.length` bytes from the file's position (the tail of an archive: hashed or skipped)."""
        from torch.distributed.checkpoint.planner import LoadItemType
        if reqs[0].type == LoadItemType.BYTE_IO:
            data = bytearray(info.length)
            read_into(f, memoryview(data), crc, self.path, self.times)
            self.loaded_bytes += [(req, data) for req in reqs]
            return
        sizes, dtype = self.reader.chunks[(reqs[0].storage_index.fqn, tuple(reqs[0].storage_index.offset))]
        nbytes, raw = math.prod(sizes) * dtype.itemsize, RAW in (info.transform_descriptors or ())
        if info.transform_descriptors and not raw:
            raise CheckpointError(f"{self.path}: item {reqs[0].storage_index.fqn} has transforms "
                                  f"{list(info.transform_descriptors)}; the kit reads none")
        if raw and nbytes != info.length:
            raise CheckpointCorruptError(f"{self.path}: item {reqs[0].storage_index.fqn} holds {info.length} bytes, "
                                         f"a {dtype} {list(sizes)} chunk has {nbytes}")
        head = b"" if raw else torchsave.head(dtype, sizes)
        got = bytearray(min(len(head), info.length))
        read_into(f, memoryview(got), crc, self.path, self.times)
        if got != head or info.length < len(head) + nbytes:  # not the kit's archive (DCP's torch.save): torch.load
            rest = bytearray(info.length - len(got))
            read_into(f, memoryview(rest), crc, self.path, self.times)
            return self.copy_out(torch.load(io.BytesIO(got + rest), map_location="cpu", weights_only=True), reqs)
        self.read_tensor(f, nbytes, sizes, dtype, reqs, crc)
        tail = info.length - len(head) - nbytes
        if crc is not None:
            self.skip(f, tail, crc)

    def read_tensor(self, f, nbytes: int, sizes: tuple, dtype, reqs: list, crc: _Crc | None) -> None:
        """The chunk's `nbytes` from the file's position into the destinations of `reqs`."""
        target = self.planner.resolve_tensor(reqs[0]).detach() if len(reqs) == 1 else None
        whole = target is not None and tuple(target.shape) == sizes and target.dtype == dtype and target.is_contiguous()
        hashed_shared = crc is not None and reqs[0].storage_index in self.shared
        if whole and target.device.type == "cpu" and not hashed_shared:
            read_into(f, byte_view(target), crc, self.path, self.times)
            return self.planner.commit_tensor(reqs[0], target)
        if whole:
            dst, buf = target.reshape(-1).view(torch.uint8), self.pinned.get()
            for i in range(0, nbytes, STAGE_BYTES):
                n = min(STAGE_BYTES, nbytes - i)
                read_into(f, byte_view(buf[:n]), crc, self.path, self.times)
                t0 = time.perf_counter()
                dst[i:i + n].copy_(buf[:n])  # blocking: the buffer is free again after it
                self.times["copy"] += time.perf_counter() - t0
            return self.planner.commit_tensor(reqs[0], target)
        saved = torch.empty(sizes, dtype=dtype)
        read_into(f, byte_view(saved), crc, self.path, self.times)
        self.copy_out(saved, reqs)

    def copy_out(self, saved: torch.Tensor, reqs: list) -> None:
        """DCP's way: the part of the saved chunk each read item asks for, copied into its destination."""
        from torch.distributed._shard._utils import narrow_tensor_by_index
        t0 = time.perf_counter()
        for req in reqs:
            part = narrow_tensor_by_index(saved, req.storage_offsets, req.lengths)
            target = self.planner.resolve_tensor(req).detach()
            if target.size() != part.size():
                raise CheckpointError(f"{self.path}: item {req.storage_index.fqn} is {list(part.shape)}, "
                                      f"its destination {list(target.shape)}")
            target.copy_(part)
            self.planner.commit_tensor(req, target)
        self.times["copy"] += time.perf_counter() - t0

    def check(self, got: int | None) -> None:
        if got is None:  # items overlapped: hash the file on its own
            got = int(integrity.file_checksum(self.path)["crc32"], 16)
        integrity.check_crc(self.path, f"{got:08x}", self.expected)

    def check_whole_file(self, error: Exception) -> None:
        """After `error` reading this file: CheckpointCorruptError if its bytes are not the saved ones."""
        want = (self.reader.checksums or {}).get(Path(self.path).name)
        if want is not None:
            try:
                integrity.check_crc(self.path, integrity.file_checksum(self.path)["crc32"], want)
            except CheckpointCorruptError as corrupt:
                raise corrupt from error


def thread_seconds(readers: list) -> dict:
    """Seconds per file of the reader threads' work (mean over files; `other`: the rest of their
    wall time: DCP's lookups, torch.load of old items) and the slowest file's wall seconds."""
    n = max(1, len(readers))
    out = {k: sum(r.times[k] for r in readers) / n for k in ("file_read", "checksum", "copy")}
    out["other"] = sum(r.wall - sum(r.times.values()) for r in readers) / n
    out["slowest_file"] = max((r.wall for r in readers), default=0.0)
    return out


def read_data(reader, plan, planner):
    """`StorageReader.read_data` for both item kinds, one thread per file (`reader.threads` at a
    time), verifying the files the coordinator gave this rank; byte items go to the planner last,
    in this thread (`load_bytes` inserts into the state's dicts)."""
    from torch.futures import Future
    checks = set(plan.storage_data or ()) if reader.checksums else set()
    per_file: dict = {}
    for item in plan.items:
        per_file.setdefault(reader.storage_data[item.storage_index].relative_path, []).append(item)
    names = sorted(set(per_file) | checks)
    shared = frozenset(shared_destinations(plan.items, planner)) if checks else frozenset()   # only hashed reads race
    readers = [FileReader(reader, n, per_file.get(n, []), planner, reader.checksums[n] if n in checks else None,
                          shared) for n in names]
    if len(readers) <= 1 or reader.threads <= 1:
        loaded = [r.run() for r in readers]
    else:
        with ThreadPoolExecutor(max_workers=min(reader.threads, len(readers))) as pool:
            loaded = list(pool.map(FileReader.run, readers))
    reader.file_s = thread_seconds(readers)
    for file_reader, items in zip(readers, loaded):
        for req, data in items:
            try:
                planner.load_bytes(req, io.BytesIO(data))
            except Exception as e:
                file_reader.check_whole_file(e)
                raise
    fut = Future()
    fut.set_result(None)
    return fut
