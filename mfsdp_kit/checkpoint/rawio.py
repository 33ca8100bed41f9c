"""DCP shard files written around the tensors' own memory: the kit's format and writer (`rawread`: its reader).

The format. A checkpoint stays a standard torch DCP checkpoint: `.metadata` is DCP's own pickled
`Metadata` (written by FileSystemWriter.finish), each rank writes `__<rank>_<i>.distcp` files, and
each item's `_StorageInfo` (relative_path, offset, length) says where its bytes are. DCP's
FileSystemWriter stores every tensor item as a `torch.save` zip (a pickle, zip records, the bytes),
read back with one `torch.load` per item, and so does stock torch's reader. Here a tensor item is that
same archive (`torchsave`: what torch.save writes with its crc32 off), its data C-contiguous, this
machine's byte order, dtype and shape those of the item's chunk in the metadata; zeros between items
start each tensor's data at a multiple of DATA_ALIGN in the file. Non-tensor items stay DCP's (torch.save
bytes, read with weights_only). Format 3 (`raw=True`, tensor_format "raw") wrote the bytes alone, marked
`[RAW]` in `_StorageInfo.transform_descriptors`, which a stock FileSystemReader refuses (ValueError
"Unknown extension name='mfsdp_kit.raw'"); `rawread` reads all three kinds, so checkpoints written
before still load.

Why. The naive writer (DCP's): per tensor, `.cpu()` into fresh pageable memory (a GPU tensor), a
clone when the tensor is a view of a larger buffer (every Megatron-FSDP shard is: torch.save would
write the whole buffer), then torch.save. Here a CPU tensor's memory goes to the file as it is (no
copy, no pickle: the archive's bytes before and after it are built from dtype and shape), a GPU tensor through one pinned buffer per writer thread (one DMA per
STAGE_BYTES); the stream crc32s each piece just before writing it (`storage.HashingStream`).
"""
from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor

import torch

from . import torchsave
from .errors import CheckpointError

RAW = "mfsdp_kit.raw/1"
"""The `_StorageInfo.transform_descriptors` entry of a raw tensor item (name/version)."""
PIECE_BYTES = 4 << 20
"""Bytes hashed and written (read) at a time: a core's share of the CPU cache, so the write copies
the bytes the crc32 just read from cache, not from memory."""
STAGE_BYTES = 64 << 20
"""Pinned buffer per thread between a GPU tensor and the file, either way."""
DATA_ALIGN = 4096
"""A tensor's data starts at a multiple of this in its file (zeros between items, in no item), so the copies
between page cache and tensor memory run page against page."""
_ZEROS = bytes(DATA_ALIGN)


def supported() -> bool:
    """Does this torch's DCP `_StorageInfo` carry transform descriptors (torch >= 2.7)?"""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    return "transform_descriptors" in {f.name for f in dataclasses.fields(_StorageInfo)}


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


class Pinned:
    """One lazily made STAGE_BYTES host buffer (pinned when CUDA is there) per thread."""

    def __init__(self):
        self.buf = None

    def get(self) -> torch.Tensor:
        if self.buf is None:
            self.buf = torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self.buf


# ---------------------------------------------------------------- save
def _nbytes(item) -> int:
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def buckets(items, n: int) -> list:
    """Write items in `n` files: byte items round-robin, tensors biggest first into the lightest file
    (DCP's `_split_by_size_and_type`); empty files are left out."""
    from torch.distributed.checkpoint.planner import WriteItemType
    out, sizes = [[] for _ in range(n)], [0] * n
    for k, item in enumerate(i for i in items if i.type == WriteItemType.BYTE_IO):
        out[k % n].append(item)
    for item in sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=_nbytes, reverse=True):
        j = sizes.index(min(sizes))
        out[j].append(item)
        sizes[j] += _nbytes(item)
    return [b for b in out if b]


def write_tensor(stream, t: torch.Tensor, item, pinned: Pinned) -> int:
    """`t`'s bytes into `stream` (CPU: straight from its memory; GPU: via the pinned buffer)."""
    chunk, props = item.tensor_data.chunk, item.tensor_data.properties
    if tuple(t.shape) != tuple(chunk.sizes) or t.dtype != props.dtype:
        raise CheckpointError(f"{item.index.fqn}: the tensor to write is {t.dtype} {list(t.shape)}, its DCP write "
                              f"item says {props.dtype} {list(chunk.sizes)}")
    t = t.detach().contiguous()
    if t.device.type == "cpu":
        return stream.write(byte_view(t))
    src, buf = t.reshape(-1).view(torch.uint8), pinned.get()
    for i in range(0, src.numel(), STAGE_BYTES):
        n = min(STAGE_BYTES, src.numel() - i)
        buf[:n].copy_(src[i:i + n])  # blocking: the buffer is complete before it is written
        stream.write(byte_view(buf[:n]))
    return src.numel()


def write_file(writer, planner, name: str, items, *, raw: bool = False) -> list:
    """One shard file: byte items as DCP writes them, then each tensor as its torch.save archive around its
    bytes (`torchsave`; `raw`: its bytes alone, marked RAW); its WriteResults."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    results, pinned = [], Pinned()
    with writer.fs.create_stream(writer.fs.concat_path(writer.path, name), "wb") as stream:
        for item in sorted(items, key=lambda i: i.type != WriteItemType.BYTE_IO):
            offset, data = stream.tell(), planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                stream.write(data.getbuffer())
                info = _StorageInfo(name, offset, stream.tell() - offset)
            elif raw:
                info = _StorageInfo(name, offset, write_tensor(stream, data, item, pinned), transform_descriptors=[RAW])
            else:
                zipped = torchsave.archive(item.tensor_data.properties.dtype, tuple(item.tensor_data.chunk.sizes))
                stream.write(_ZEROS[:-(offset + len(zipped.head)) % DATA_ALIGN])
                offset = stream.tell()
                stream.write(zipped.head)
                write_tensor(stream, data, item, pinned)
                stream.write(zipped.tail)
                info = _StorageInfo(name, offset, stream.tell() - offset)
            results.append(WriteResult(index=item.index, size_in_bytes=info.length, storage_data=info))
    return results


def write_data(writer, plan, planner, *, raw: bool = False):
    """`StorageWriter.write_data` in this format: `writer.thread_count` files, one thread each."""
    from torch.futures import Future
    groups = buckets(plan.items, writer.thread_count)
    names = [f"{plan.storage_data.prefix}{i}.distcp" for i in range(len(groups))]
    if len(groups) <= 1:
        results = [write_file(writer, planner, n, g, raw=raw) for n, g in zip(names, groups)]
    else:
        with ThreadPoolExecutor(max_workers=len(groups)) as pool:
            results = list(pool.map(lambda ng: write_file(writer, planner, *ng, raw=raw), zip(names, groups)))
    fut = Future()
    fut.set_result([r for rs in results for r in rs])
    return fut
