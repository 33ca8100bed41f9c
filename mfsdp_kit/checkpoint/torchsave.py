"""One tensor as the torch.save archive stock torch reads, written around the tensor's own bytes.

What a DCP tensor item must be for torch's own reader: `FileSystemReader.read_data` (torch 2.13,
torch/distributed/checkpoint/filesystem.py) calls `torch.load(weights_only=True)` on every tensor item's
byte range, so `dcp_to_torch_save`, verl's and torchtitan's converters, and anyone without the kit read
exactly that: a torch.save archive. The naive way to write one is DCP's (`torch.save` per item: a copy of
a GPU tensor into fresh pageable memory, a clone of a view, the pickler and the zip writer copying the
bytes again: about half of a save's write, docs/benchmarks.md, checkpoint, "After the checkpoint I/O changes"); the
kit's first fast format wrote the bytes alone, which torch refuses.

Here: a torch.save archive is a zip of stored (uncompressed) records - `data.pkl` (the pickle: "rebuild a
tensor of this dtype, shape and strides from storage 0 of N elements"), a few one-line records, the
tensor's bytes as `data/0` (aligned to 64 bytes), then `version`, `.data/serialization_id` and the central
directory. Everything but `data/0` depends only on dtype and shape, so `archive` builds the bytes before
(`head`) and after (`tail`) the data, and the writer streams the tensor's memory between them (`rawio`):
the same zero-copy path as raw bytes, and the item is what `torch.save(t)` writes with
`torch.serialization.set_crc32_options(False)` (the kit's file crc32 covers the bytes; torch.load does not
check a record's crc32), byte for byte, apart from the random serialization id.

Reading: the kit's reader rebuilds `head` for the chunk's dtype and shape and compares it with the item's
first bytes; equal, the data follows and goes straight into the destination (no pickle is run); not equal
(DCP's own torch.save items, another torch), the item goes through torch.load as before.

The zip records mirror miniz as torch 2.13 writes them (caffe2/serialize/inline_container.cc): local headers
with sizes and crc32 0 and a data descriptor after the data (flags 0x0808), padding in an extra field "FB"
so the data starts at a multiple of 64, zip64 fields for a size or offset >= 2**32 - 1, and the zip64 end
records always.
"""
from __future__ import annotations

import functools
import math
import secrets
import struct
import sys
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..fieldtypes import bad_value

ALIGN = 64
"""Bytes the start of every record's data is a multiple of (torch's `_get_storage_alignment()` default)."""
ZIP64 = 0xFFFFFFFF
"""A size or offset at least this large goes into a zip64 extra field (the 32-bit field then says 0xFFFFFFFF)."""
PREFIX = "archive/"
"""torch.save's record-name prefix when it writes to a stream (DCP's case)."""
ID_DIGITS = 40
"""Digits of `.data/serialization_id` (torch's length)."""
RECORDS_BEFORE = ((".format_version", b"1"), (".storage_alignment", str(ALIGN).encode()),
                  ("byteorder", sys.byteorder.encode()))
"""Records torch.save writes between `data.pkl` and the tensor's storage, in its order."""
VERSION = b"3\n"
"""The `version` record (torch's kProducedFileFormatVersion, 2.13)."""


@dataclass(frozen=True)
class Archive:
    """The bytes of one tensor's archive before its data (`head`) and after it (`tail`)."""
    head: bytes
    tail: bytes
    nbytes: int
    """Bytes of the tensor's data between them."""


def pickle_bytes(dtype: torch.dtype, sizes: tuple) -> bytes:
    """`data.pkl` of a contiguous CPU tensor of `dtype` and `sizes` on storage "0" (storage offset 0, no
    grad): the pickle torch.save writes (`Tensor._reduce_ex_internal`, `serialization._save`)."""
    import io
    import pickle
    numel = math.prod(sizes)
    stride = torch.empty(sizes, dtype=dtype, device="meta").stride()
    new_dtype = dtype in torch.storage._new_dtypes()
    storage_type = torch.UntypedStorage if new_dtype else getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])
    storage_numel = numel * dtype.itemsize if new_dtype else numel

    class Storage:
        """Stands for the tensor's storage: the pickler writes its persistent id, never its bytes."""

    class Tensor:
        pass

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", storage_type, "0", "cpu", storage_numel) if isinstance(obj, Storage) else None

        def reducer_override(self, obj):
            if not isinstance(obj, Tensor):
                return NotImplemented
            args = (Storage(), 0, tuple(sizes), stride, False, OrderedDict())
            return (torch._utils._rebuild_tensor_v3, args + (dtype,)) if new_dtype else (torch._utils._rebuild_tensor_v2, args)

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(Tensor())
    return buf.getvalue()


def _zip64(size: int, offset: int, *, local: bool) -> bytes:
    """The zip64 extra field of a record (b"" when it needs none): sizes (uncompressed, compressed: the local
    header's says 0, as miniz's, the data descriptor follows), then the local header's offset."""
    fields = b""
    if size >= ZIP64:
        fields += struct.pack("<QQ", size, 0 if local else size)
    if offset >= ZIP64:
        fields += struct.pack("<Q", offset)
    return struct.pack("<HH", 1, len(fields)) + fields if fields else b""


def local_header(name: str, offset: int, size: int) -> bytes:
    """A record's local header at `offset`, padded so that its data starts at a multiple of ALIGN."""
    fname = (PREFIX + name).encode()
    z64 = _zip64(size, offset, local=True)
    pad = -(offset + 30 + len(fname) + len(z64) + 4) % ALIGN
    extra = z64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, _flags(size), 0, 0, 0, 0, 0, 0, len(fname), len(extra)) + fname + extra


def _flags(size: int) -> int:
    """UTF-8 names (0x0800), and a data descriptor after the data (0x0008) unless the record is empty."""
    return 0x0808 if size else 0x0800


def descriptor(offset: int, size: int) -> bytes:
    """The data descriptor after a record's data (crc32 0: torch.save's when its crc32 is off); none when empty."""
    if size == 0:
        return b""
    if size >= ZIP64 or offset >= ZIP64:
        return struct.pack("<IIQQ", 0x08074B50, 0, size, size)
    return struct.pack("<IIII", 0x08074B50, 0, size, size)


def central_entry(name: str, offset: int, size: int) -> bytes:
    fname, extra = (PREFIX + name).encode(), _zip64(size, offset, local=False)
    small = size if size < ZIP64 else ZIP64
    return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, _flags(size), 0, 0, 0, 0, small, small, len(fname),
                       len(extra), 0, 0, 0, 0, min(offset, ZIP64)) + fname + extra


def end_records(count: int, cd_offset: int, cd_size: int) -> bytes:
    """zip64 end of central directory, its locator, and the end of central directory."""
    z64_at = cd_offset + cd_size
    return (struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0, count, count, cd_size, cd_offset)
            + struct.pack("<IIQI", 0x07064B50, 0, z64_at, 1)
            + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, min(cd_size, ZIP64), min(cd_offset, ZIP64), 0))


@functools.lru_cache(maxsize=4096)
def _parts(dtype: torch.dtype, sizes: tuple) -> tuple[bytes, bytes, bytes]:
    """(head, the tail up to the serialization id, the tail after it) of a tensor of `dtype` and `sizes`."""
    nbytes = math.prod(sizes) * dtype.itemsize
    records = [("data.pkl", pickle_bytes(dtype, sizes)), *RECORDS_BEFORE, ("data/0", nbytes), ("version", VERSION),
               (".data/serialization_id", b"\0" * ID_DIGITS)]
    out, central, pos = [], [], 0
    for name, data in records:
        size = data if isinstance(data, int) else len(data)
        header = local_header(name, pos, size)
        central.append(central_entry(name, pos, size))
        out += [header, b"" if isinstance(data, int) else data, descriptor(pos, size)]
        pos += len(header) + size + len(out[-1])
    central_bytes = b"".join(central)
    # out holds [header, data, descriptor] per record: data/0 is record 4 (its data, out[13], is the tensor's),
    # the serialization id record 6 (its data, out[19], is per archive)
    return (b"".join(out[:13]), b"".join(out[14:19]),
            out[20] + central_bytes + end_records(len(records), pos, len(central_bytes)))


def archive(dtype: torch.dtype, sizes, *, serialization_id: str | None = None) -> Archive:
    """The archive of a contiguous tensor of `dtype` and `sizes` around its data (see the module docstring).
    `serialization_id`: ID_DIGITS decimal digits (default: random, as torch.save's)."""
    sid = serialization_id if serialization_id is not None else f"{secrets.randbelow(10 ** ID_DIGITS):0{ID_DIGITS}d}"
    if len(sid) != ID_DIGITS or not sid.isdigit():
        raise bad_value("serialization_id", sid, f"{ID_DIGITS} decimal digits")
    head, before_id, after_id = _parts(dtype, tuple(sizes))
    return Archive(head=head, tail=before_id + sid.encode() + after_id, nbytes=math.prod(sizes) * dtype.itemsize)


def head(dtype: torch.dtype, sizes) -> bytes:
    """The bytes a kit-written item of this dtype and shape starts with (what the reader compares)."""
    return _parts(dtype, tuple(sizes))[0]
