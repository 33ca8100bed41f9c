"""Reading a checkpoint never runs code from it; and who may have written it is checked first.

torch DCP pickles its `.metadata` file (and non-tensor values, such as the optimizer's param-group
table, inside the `.distcp` shards). The naive reader, `pickle.load`, calls whatever callable the
file names: a `.metadata` whose pickle says "call os.system('...')" runs that command as the user
who loads it. Two defences:

1. An allow-list unpickler (the `torch.load(weights_only=True)` idea applied to DCP). `SafeReader`
   is DCP's FileSystemReader with `read_metadata` going through `MetadataUnpickler`, which resolves
   only the classes DCP metadata is made of (`ALLOWED`, torch dtypes / layouts / memory formats)
   and refuses every other global, naming it. `SafeLoadPlanner` reads the non-tensor values with
   `torch.load(weights_only=True)` where DCP's default planner uses `weights_only=False`. Every
   `dcp.load` of the kit goes through both, with or without `trust_checkpoint=True`.
2. `check_trusted`, defence in depth like OpenSSH's StrictModes: every path from the checkpoint
   root down (root directory, step directory, each file) and the `latest` pointer must be owned
   by you or root and not writable by group or others (a directory with the sticky bit, like
   /tmp, may be world-writable: others cannot replace what you own in it). Otherwise another user
   could have put the bytes there. `trust_checkpoint=True` skips this check, not the unpickler.
   A save runs the same check on the root and on every name it will create or replace (`check_save`),
   and no path in a checkpoint may be a symlink: a link planted where the save writes would turn it
   into a write anywhere the saving user may write, and one in a step folder would make a load read
   a file outside it. A symlink's own mode is always 0777, so it gets its own message (`symlink`).
"""
from __future__ import annotations

import os
import pickle
import pwd
import stat
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .errors import CheckpointCorruptError, CheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED = {
    (_DCP_METADATA, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name, nothing else
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
}
"""(module, name) globals a DCP `.metadata` may name (torch 2.13's FileSystemWriter output)."""


def _torch_constant(module: str, name: str) -> bool:
    """torch.float32, torch.strided, torch.contiguous_format ...: values, not callables."""
    value = getattr(torch, name, None) if module == "torch" else None
    return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))


class MetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only `ALLOWED` globals and torch constants.

    Every callable a pickle can invoke (REDUCE, NEWOBJ, BUILD's class) is first looked up with
    `find_class`, so refusing here refuses the call. Persistent ids are refused by the base class.
    """

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED or _torch_constant(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def load_metadata(path) -> Metadata:
    """A DCP `.metadata` file, unpickled with `MetadataUnpickler`; CheckpointError when refused."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path} was refused: {e}. A DCP metadata file holds only torch's metadata "
                              "classes; this one names code to run. Do not load this checkpoint") from e
    except (EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise CheckpointCorruptError(f"{path} is not a readable DCP metadata file ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointCorruptError(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader whose `read_metadata` uses `load_metadata` instead of `pickle.load`.

    Mirrors torch 2.13's FileSystemReader.read_metadata (torch/distributed/checkpoint/filesystem.py):
    same file name, and the same `storage_meta.load_id` bookkeeping afterwards.
    """

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = load_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with `torch.load(weights_only=True)`.

    DefaultLoadPlanner.load_bytes uses `weights_only=False` (torch 2.13, default_planner.py), i.e. a
    full unpickle of whatever the shard holds; the optimizer's param-group table (floats, tuples,
    strings) needs nothing beyond what weights_only allows.
    """

    def load_bytes(self, read_item, value) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"non-tensor value {read_item.dest_index.fqn!r} was refused: {e}") from e
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


# ---------------------------------------------------------------- StrictModes
def _owner(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


RISK = {"load": "loading a DCP checkpoint unpickles its metadata, so whoever can write there decides what the "
                 "load does",
        "save": "whoever can write there can plant symlinks or files where the save writes, and so make it "
                "overwrite files anywhere you can write"}
"""Why a path someone else could write is refused, by the action refused."""


def _refusal(p: Path, why: str, fix: str, action: str = "load") -> CheckpointError:
    return CheckpointError(f"{p} {why}: {RISK[action]}. {fix}, or pass trust_checkpoint=True if you trust everyone "
                           "who can write there")


def symlink(p: Path, action: str = "load") -> CheckpointError:
    """The refusal of a symlink: what points where, and what to do (chmod cannot change a link's mode)."""
    target = os.readlink(p)
    return CheckpointError(
        f"{p} is a symlink to {target!r} (resolves to {p.resolve()}): the kit never {action}s through a symlink "
        "in a checkpoint, because whoever can change the link decides which file is read or overwritten. Pass the "
        f"real path ({p.resolve()}) instead of a linked root, or replace the link with what it points to "
        f"(rm {p}; then move or copy the real file or folder there); a link you did not make: delete it, and check "
        "who can write into its folder")


def check_path(p: Path, *, action: str = "load") -> None:
    """One path: not a symlink; owned by you or root; not group/other-writable (a sticky directory may be)."""
    me, st = os.geteuid(), os.lstat(p)
    if stat.S_ISLNK(st.st_mode):
        raise symlink(p, action)
    if st.st_uid not in (me, 0):
        raise _refusal(p, f"is owned by {_owner(st.st_uid)}, not by you ({_owner(me)}) or root",
                       "chown it to yourself", action)
    sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky_dir:
        raise _refusal(p, f"is writable by group or others (mode {stat.filemode(st.st_mode)})", "chmod go-w it",
                       action)


def check_trusted(path, *, root=None, pointer=None) -> None:
    """Refuse a checkpoint someone else could have written (see the module docstring).

    Checks `root` (default: the step directory's parent), the step directory `path`, every file
    in it, and the `latest` `pointer` file when given. Raises CheckpointError naming the path.
    """
    path = Path(path)
    root = Path(root) if root is not None else path.parent
    for p in [root, *([Path(pointer)] if pointer else []), path, *sorted(path.iterdir())]:
        check_path(p)


def check_save(root: Path, names) -> None:
    """A save's root, and each of `names` in it that exists already (`latest`, the step and its `.tmp-`
    folder), as `check_path` checks a load's: a planted link or another user's entry is refused."""
    check_path(root, action="save")
    for name in names:
        if os.path.lexists(root / name):
            check_path(root / name, action="save")
