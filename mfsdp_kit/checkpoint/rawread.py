"""The kit's reader of DCP shard files (`rawio` has the format and the writer): straight into the tensors' memory.

The naive reader: per item, read the slice, `torch.load` it into a new tensor, copy that into the
destination. Here each file is read in offset order, one thread per file: an item whose first bytes are
the archive head the kit writes for its chunk (raw items: none) has its data next (any other, DCP's own:
torch.load); that data is `readinto` the destination's memory when it is a contiguous CPU tensor of the
saved chunk (the same layout); a GPU destination gets it through a per-thread buffer; anything else
(another layout: a part of the chunk) through a buffer and DCP's narrow + copy.

No checksum here: `restore.load_dir` has crc32'd every shard file (each on one rank, every rank agreeing)
before DCP starts, so a damaged file is refused before any byte of the checkpoint reaches a tensor. A
check while reading (the bytes read once) found damage only after DCP had copied part of the
checkpoint into the live model, whose own tensors it reads into.
"""
from __future__ import annotations

import io
import math
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from . import rawio, torchsave
from .errors import CheckpointCorruptError, CheckpointError
from .rawio import PIECE_BYTES, RAW, STAGE_BYTES, byte_view


def chunk_table(metadata) -> dict:
    """{(fqn, chunk offsets): (chunk sizes, dtype)} of every saved tensor chunk."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    return {(fqn, tuple(c.offsets)): (tuple(c.sizes), md.properties.dtype)
            for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
            for c in md.chunks}


def read_into(f, view: memoryview, path, times: dict) -> None:
    """Fill `view` from `f`, PIECE_BYTES at a time; the read's seconds go to `times["file_read"]`."""
    for i in range(0, len(view), PIECE_BYTES):
        piece = view[i:i + PIECE_BYTES]
        got, t0 = 0, time.perf_counter()
        while got < len(piece):
            n = f.readinto(piece[got:])
            if not n:
                raise CheckpointCorruptError(f"{path} ends at byte {f.tell()}: an item needs more; the file is truncated")
            got += n
        times["file_read"] += time.perf_counter() - t0


class FileReader:
    """Reads one shard file's items for `reader` (a `storage.ParallelReader`) in offset order."""

    def __init__(self, reader, name: str, items: list, planner):
        self.reader, self.planner = reader, planner
        self.path = reader.fs.concat_path(reader.path, name)
        self.items, self.pinned, self.loaded_bytes = items, rawio.Pinned(), []
        self.times = dict.fromkeys(("file_read", "copy"), 0.0)
        """Seconds of this file's reads and copies into the destinations; `wall` all of them."""
        self.wall = 0.0

    def run(self) -> list:
        """Read every item; [(read item, bytes)] of byte items."""
        start, groups = time.perf_counter(), {}
        for req in self.items:
            info = self.reader.storage_data[req.storage_index]
            groups.setdefault((info.offset, info.length), (info, []))[1].append(req)
        with open(self.path, "rb", buffering=0) as f:
            for (offset, _), (info, reqs) in sorted(groups.items(), key=lambda kv: kv[0]):
                f.seek(offset)
                self.read_item(f, info, reqs)
        self.wall = time.perf_counter() - start
        return self.loaded_bytes

    def read_item(self, f, info, reqs: list) -> None:
        """One item, from the file's position (an archive's tail is left unread)."""
        from torch.distributed.checkpoint.planner import LoadItemType
        if reqs[0].type == LoadItemType.BYTE_IO:
            data = bytearray(info.length)
            read_into(f, memoryview(data), self.path, self.times)
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
        read_into(f, memoryview(got), self.path, self.times)
        if got != head or info.length < len(head) + nbytes:  # not the kit's archive (DCP's torch.save): torch.load
            rest = bytearray(info.length - len(got))
            read_into(f, memoryview(rest), self.path, self.times)
            return self.copy_out(torch.load(io.BytesIO(got + rest), map_location="cpu", weights_only=True), reqs)
        self.read_tensor(f, nbytes, sizes, dtype, reqs)

    def read_tensor(self, f, nbytes: int, sizes: tuple, dtype, reqs: list) -> None:
        """The chunk's `nbytes` from the file's position into the destinations of `reqs`."""
        target = self.planner.resolve_tensor(reqs[0]).detach() if len(reqs) == 1 else None
        whole = target is not None and tuple(target.shape) == sizes and target.dtype == dtype and target.is_contiguous()
        if whole and target.device.type == "cpu":
            read_into(f, byte_view(target), self.path, self.times)
            return self.planner.commit_tensor(reqs[0], target)
        if whole:
            dst, buf = target.reshape(-1).view(torch.uint8), self.pinned.get()
            for i in range(0, nbytes, STAGE_BYTES):
                n = min(STAGE_BYTES, nbytes - i)
                read_into(f, byte_view(buf[:n]), self.path, self.times)
                t0 = time.perf_counter()
                dst[i:i + n].copy_(buf[:n])  # blocking: the buffer is free again after it
                self.times["copy"] += time.perf_counter() - t0
            return self.planner.commit_tensor(reqs[0], target)
        saved = torch.empty(sizes, dtype=dtype)
        read_into(f, byte_view(saved), self.path, self.times)
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


def thread_seconds(readers: list) -> dict:
    """Seconds per file of the reader threads' work (mean over files; `other`: the rest of their
    wall time: DCP's lookups, torch.load of old items) and the slowest file's wall seconds."""
    n = max(1, len(readers))
    out = {k: sum(r.times[k] for r in readers) / n for k in ("file_read", "copy")}
    out["other"] = sum(r.wall - sum(r.times.values()) for r in readers) / n
    out["slowest_file"] = max((r.wall for r in readers), default=0.0)
    return out


def read_data(reader, plan, planner):
    """`StorageReader.read_data` for both item kinds, one thread per file (`reader.threads` at a
    time); byte items go to the planner last, in this thread (`load_bytes` inserts into the state's dicts)."""
    from torch.futures import Future
    per_file: dict = {}
    for item in plan.items:
        per_file.setdefault(reader.storage_data[item.storage_index].relative_path, []).append(item)
    readers = [FileReader(reader, n, items, planner) for n, items in sorted(per_file.items())]
    if len(readers) <= 1 or reader.threads <= 1:
        loaded = [r.run() for r in readers]
    else:
        with ThreadPoolExecutor(max_workers=min(reader.threads, len(readers))) as pool:
            loaded = list(pool.map(FileReader.run, readers))
    reader.file_s = thread_seconds(readers)
    for items in loaded:
        for req, data in items:
            planner.load_bytes(req, io.BytesIO(data))
    fut = Future()
    fut.set_result(None)
    return fut
