"""The shard files' tensor format, in one process (no process group, a few MB, ~2 s): the default items
(torch.save archives written around the tensors: `torchsave`) are read by stock torch alone, bit for bit;
raw tensor items (`rawio`, format 3) and DCP's torch.save items (format 2) both round-trip bitwise through the
kit's reader, the standard DCP metadata marks the raw items (a stock reader refuses them, and still
reads the old format), checkpoints of every format load with today's default manager, and a damaged shard is
refused by the checks before the read, the state to load into untouched."""
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from mfsdp_kit import checkpoint as ckpt
from mfsdp_kit.checkpoint.rawio import RAW
from mfsdp_kit.checkpoint.trust import load_metadata
from tests import stock_torch


class Tensors:
    """A Stateful of assorted tensors: dtypes, 0-dim, empty, a view into a larger buffer, a
    transposed (non-contiguous) one, one over 4 MiB (more than one piece)."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        big = torch.randn(3, 700_000, generator=g)
        self.tensors = {"bf16": torch.randn(64, 33, generator=g).to(torch.bfloat16),
                        "int64": torch.randint(0, 1 << 40, (17,), generator=g), "scalar": torch.tensor(seed * 1.5),
                        "empty": torch.empty(0, 8), "view": big[1], "transposed": torch.randn(40, 24, generator=g).t(),
                        "large": torch.randn(1_200_000, generator=g), "flags": torch.rand(9, generator=g) > 0.5}

    def state_dict(self):
        return dict(self.tensors)

    def load_state_dict(self, state_dict):
        for k, v in state_dict.items():
            self.tensors[k].copy_(v)


def _equal(a: Tensors, b: Tensors) -> bool:
    return all(x.dtype == b.tensors[k].dtype and torch.equal(x, b.tensors[k]) for k, x in a.tensors.items())


@pytest.mark.parametrize("tensor_format", ["raw", "torch_save"])
def test_both_formats_round_trip_bitwise(tmp_path, tensor_format):
    mgr = ckpt.CheckpointManager(tmp_path / tensor_format, tensor_format=tensor_format, write_threads=2)
    saved = Tensors(1)
    path = mgr.save(1, {"t": saved})
    assert ckpt.read_meta(path)["format"] == (3 if tensor_format == "raw" else 2)
    descriptors = {tuple(info.transform_descriptors or ()) for info in load_metadata(path / ".metadata").storage_data.values()}
    assert descriptors == ({(RAW,)} if tensor_format == "raw" else {()})
    loaded = Tensors(2)
    assert not _equal(saved, loaded)
    ckpt.CheckpointManager(tmp_path / tensor_format).load({"t": loaded})  # either format, the default manager
    assert _equal(saved, loaded)


def test_stock_dcp_reader_refuses_raw_items_and_reads_the_old_format(tmp_path):
    for tensor_format in ("raw", "torch_save"):
        ckpt.CheckpointManager(tmp_path / tensor_format, tensor_format=tensor_format).save(1, {"t": Tensors(1)})
    into = {"t": Tensors(2).state_dict()}
    with pytest.raises(BaseException, match="Unknown extension name='mfsdp_kit.raw'"):
        dcp.load(into, storage_reader=FileSystemReader(str(tmp_path / "raw" / "step_000001")))
    dcp.load(into, storage_reader=FileSystemReader(str(tmp_path / "torch_save" / "step_000001")))
    assert all(torch.equal(v, Tensors(1).tensors[k]) for k, v in into["t"].items())


@pytest.mark.parametrize("tensor_format", ["raw", "torch_save"])
def test_damaged_shard_is_refused_before_reading(tmp_path, tensor_format):
    mgr = ckpt.CheckpointManager(tmp_path, tensor_format=tensor_format)
    mgr.save(1, {"t": Tensors(1)})
    mgr.save(2, {"t": Tensors(3)})
    shard = tmp_path / "step_000002" / "__0_0.distcp"
    shard.chmod(0o644)
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x10
    shard.write_bytes(bytes(data))
    into = Tensors(2)
    with pytest.raises(ckpt.CheckpointCorruptError, match=rf"{shard} has crc32 \w+, \w+ was saved"):
        mgr.load({"t": into})
    assert _equal(Tensors(2), into)   # refused before any tensor was read
    with pytest.raises(ckpt.CheckpointCorruptError, match=rf"{shard} has crc32"):
        mgr.load({}, step=2)  # nothing to read: the shard files are checked all the same
    loaded = Tensors(2)
    with pytest.warns(UserWarning, match="instead of the damaged step_000002"):
        info = mgr.load({"t": loaded}, fallback=True)
    assert info["step"] == 1 and _equal(Tensors(1), loaded)


def test_stock_torch_reads_the_default_checkpoint_without_the_kit(tmp_path):
    saved = Tensors(1)
    path = ckpt.CheckpointManager(tmp_path / "root", write_threads=2).save(1, {"t": saved})
    assert ckpt.read_meta(path)["format"] == 4
    assert all(not info.transform_descriptors for info in load_metadata(path / ".metadata").storage_data.values())
    converted, loaded = stock_torch.read(path, tmp_path / "stock")
    for name, want in saved.tensors.items():
        for got in (converted["t"][name], loaded[f"t.{name}"]):
            assert got.dtype == want.dtype and torch.equal(got, want), name


@pytest.mark.parametrize("tensor_format", ["raw", "torch_save", "standard"])
def test_every_format_loads_with_the_default_manager(tmp_path, tensor_format):
    """Checkpoints written before (format 3: raw, 2: torch_save) and now load through the same reader."""
    ckpt.CheckpointManager(tmp_path, tensor_format=tensor_format).save(1, {"t": Tensors(1), "u": Tensors(5)})
    loaded, other = Tensors(2), Tensors(3)
    info = ckpt.CheckpointManager(tmp_path).load({"t": loaded, "u": other})
    assert info["format"] == {"raw": 3, "torch_save": 2, "standard": 4}[tensor_format]
    assert _equal(Tensors(1), loaded) and _equal(Tensors(5), other)


@pytest.mark.parametrize("where", ["tensor bytes", "archive head"])
def test_damaged_default_shard_is_refused_before_reading(tmp_path, where):
    """A flipped bit in a tensor's bytes, or in the zip and pickle bytes before them (then the item no longer
    matches the kit's own head and goes through torch.load): CheckpointCorruptError naming the file."""
    mgr = ckpt.CheckpointManager(tmp_path)
    path = mgr.save(1, {"t": Tensors(1)})
    info = next(i for i in load_metadata(path / ".metadata").storage_data.values() if i.length > 4 << 20)
    shard = path / info.relative_path
    shard.chmod(0o644)
    data = bytearray(shard.read_bytes())
    data[info.offset + (info.length // 2 if where == "tensor bytes" else 100)] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointCorruptError, match=rf"{shard} has crc32 \w+, \w+ was saved"):
        mgr.load({"t": Tensors(2)})


class Aliased(Tensors):
    """Tensors plus a weight and a view of part of it, as Megatron's distributed optimizer holds an fp32
    weight's main-param shard: two items whose destinations share memory."""

    def __init__(self, seed: int):
        super().__init__(seed)
        weight = torch.randn(64, 1000, generator=torch.Generator().manual_seed(seed + 100))
        self.tensors.update(weight=weight, main_param=weight.view(-1)[1000:30000])


def test_aliased_destinations_round_trip_and_damage_is_found(tmp_path):
    """Two reader threads fill the same memory (the same saved bytes) and the round trip is exact; damage in the
    weight's bytes outside the view is refused by the checks before the read (a crc32 taken while reading found it
only when those items went through a private buffer: a thread could hash what another wrote there)."""
    mgr = ckpt.CheckpointManager(tmp_path, write_threads=4, read_threads=4)
    path = mgr.save(1, {"t": Aliased(1)})
    loaded = Aliased(2)
    mgr.load({"t": loaded})
    assert _equal(Aliased(1), loaded)
    info = load_metadata(path / ".metadata").storage_data
    weight = next(i for k, i in info.items() if k.fqn == "t.weight")
    shard = path / weight.relative_path
    shard.chmod(0o644)
    data = bytearray(shard.read_bytes())
    data[weight.offset + weight.length // 2] ^= 0x10   # in the weight's bytes, outside its main-param view
    shard.write_bytes(bytes(data))
    into = Aliased(3)
    with pytest.raises(ckpt.CheckpointCorruptError, match=rf"{shard} has crc32 \w+, \w+ was saved"):
        mgr.load({"t": into})
    assert _equal(Aliased(3), into)   # refused before any tensor was read
