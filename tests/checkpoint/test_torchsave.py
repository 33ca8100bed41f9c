"""`torchsave.archive` around a tensor's bytes is what torch.save writes (its crc32 off), byte for byte, apart
from the random serialization id: for every kind of dtype torch pickles (legacy <type>Storage, float8 and the
unsigned ones as UntypedStorage), 0-dim and empty tensors, and sizes around the zip64 limit (2**32 - 1 bytes;
torch.save's writer gets those bytes as a memoryview, so nothing of 4 GiB is copied or touched)."""
import io
import re

import pytest
import torch

from mfsdp_kit.checkpoint import torchsave

ID = re.compile(rb"Z(\d{40})PK\x07\x08")
"""The serialization id: the padding of its record's header (Z...), 40 digits, then its data descriptor."""


@pytest.fixture
def crc_off():
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    yield
    torch.serialization.set_crc32_options(before)


CASES = {"fp32 matrix": torch.randn(10, 100), "bf16": torch.randn(64, 33).bfloat16(), "int64": torch.arange(17),
         "0-dim": torch.tensor(1.5), "empty": torch.empty(0, 8), "bool": torch.arange(9) % 2 == 0,
         "fp16 with a size-1 dim": torch.randn(3, 1, 4).half(), "float8": torch.randn(5).to(torch.float8_e4m3fn),
         "uint16": torch.arange(6).to(torch.uint16), "complex64": torch.randn(2, 3, dtype=torch.complex64),
         "fp64": torch.randn(3, 4).double(), "int8": torch.arange(4).to(torch.int8)}


@pytest.mark.parametrize("case", list(CASES))
def test_archive_is_torch_save(case, crc_off):
    t = CASES[case]
    buf = io.BytesIO()
    torch.save(t, buf)
    want = buf.getvalue()
    sid = ID.search(want).group(1).decode()
    mine = torchsave.archive(t.dtype, t.shape, serialization_id=sid)
    assert mine.head + t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() + mine.tail == want
    assert mine.head == torchsave.head(t.dtype, tuple(t.shape))
    other = torchsave.archive(t.dtype, t.shape)  # a random id: another archive, the same head
    assert other.head == mine.head and other.tail != mine.tail and len(other.tail) == len(mine.tail)


class Recorder:
    """A file-like torch.save writes into: small writes kept, the data record (>= 1 MiB) only counted."""

    def __init__(self):
        self.parts = []

    def write(self, data) -> int:
        self.parts.append(bytes(data) if len(data) < (1 << 20) else None)
        return len(data)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("nbytes", [(1 << 32) - 700, (1 << 32) - 2, (1 << 32) - 1, (1 << 32) + 5])
def test_zip64_archive_is_torch_save(nbytes, crc_off):
    rec = Recorder()
    torch.save(torch.empty(nbytes, dtype=torch.uint8), rec)  # never touched: its pages are never made
    k = rec.parts.index(None)
    head, tail = b"".join(rec.parts[:k]), b"".join(rec.parts[k + 1:])
    mine = torchsave.archive(torch.uint8, (nbytes,), serialization_id=ID.search(tail).group(1).decode())
    assert (mine.head, mine.tail, mine.nbytes) == (head, tail, nbytes)


def test_serialization_id_is_checked():
    with pytest.raises(ValueError, match="serialization_id='12' is not allowed; allowed: 40 decimal digits"):
        torchsave.archive(torch.float32, (2,), serialization_id="12")
