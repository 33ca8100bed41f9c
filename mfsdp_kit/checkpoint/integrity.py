"""Is a checkpoint intact, and does it fit this model? Both answered before any tensor is read.

Intact: the naive load trusts the bytes; 256 flipped bytes in a shard then load silently as a
tensor off by 1e24. So every file gets a checksum at save: each rank's writer threads hash the
shard files they write (`__<rank>_*.distcp`) as the bytes go out (`storage.HashingStream`); rank 0
hashes the rest (`.metadata`, `scheduler.json`) at commit; `meta.json` records `{file: {bytes, crc32}}`.
zlib.crc32 is the fastest of the standard library's hashes per core (ahead of sha256 and blake2b)
and a small share of a save; a rank's files hash in parallel threads (measured: docs/checkpoint.md,
"crc32 cost"; docs/benchmarks.md, "Figures that used to live in docstrings"). crc32 is an integrity
check against bit rot and truncation, not a signature (who may write the files is
`trust.check_trusted`'s job). A load checks every file's size on every rank, and each file's crc32
on one rank (file i on rank i % world size), every rank agreeing, before the first tensor is read:
DCP reads into the live model's own tensors, so a check while reading (the bytes read once) found
damage only after part of the checkpoint had landed in the model. The price is a second read of
each shard file's bytes (from the page cache the check filled): docs/checkpoint.md has the numbers.

Contained: DCP's `.metadata` says, per item, which file holds its bytes (`relative_path`), and DCP
joins that to the folder as it is: `"../../secret"` or an absolute path reads any file the user can
read into the model, and no checksum covers it. So every file meta.json lists is a plain name in the
step folder (no `/`, no link out of it: `check_files`), every storage path in `.metadata` is one of
those shard files (`check_storage`), and every listed file has a size and crc32 in meta.json; a
checkpoint without checksums (format 1, or a key deleted) loads only with `trust_checkpoint=True`.

Fits: the naive load lets DCP match keys; keys the model lacks are silently dropped (a 2-layer
checkpoint loads into a 1-layer model) and mismatched shapes fail deep in DCP. `check_fit`
compares the DCP metadata's keys and global sizes with the state about to be loaded and lists
the missing, unexpected and mismatched names, with both shapes.
"""
from __future__ import annotations

import hashlib
import json
import warnings
import zlib
from pathlib import Path

import torch

from .errors import CheckpointCorruptError, CheckpointError
from .trust import symlink

META = "meta.json"
CHUNK_BYTES = 1 << 20
"""Bytes hashed per read, into one buffer per file: it stays in the core's cache from the read's copy to the
crc32. A fresh 8 MiB `f.read` per piece (page faults, zeroing) hashed 1.6 GB at half the speed (0.57 vs 0.29 s,
4 threads on this 2-core machine)."""
SHOWN = 5
"""Names listed per kind in a does-not-fit error."""
DIGEST = "meta_sha256"
"""meta.json's field holding `seal(meta)`, its own checksum (and so, through `checksums`, every file's)."""
READ_FORMATS = (1, 2, 3, 4)
"""meta.json `format`s this kit reads (manager.FORMATS: what a `tensor_format` writes)."""


def file_checksum(path) -> dict:
    """{"bytes": size, "crc32": 8 hex digits} of one file, read in CHUNK_BYTES pieces."""
    crc, size, buf = 0, 0, memoryview(bytearray(CHUNK_BYTES))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(buf[:n], crc)
            size += n
    return {"bytes": size, "crc32": f"{crc:08x}"}


def rank_files(directory: Path, rank: int) -> list[str]:
    """The shard files DCP's FileSystemWriter wrote for `rank` (it names them `__<rank>_<i>.distcp`)."""
    return sorted(p.name for p in Path(directory).glob(f"__{rank}_*.distcp"))


def checksums(directory: Path, names, *, threads: int = 4) -> dict:
    """{name: file_checksum} for files in `directory`, `threads` files at a time (zlib.crc32 and
    file reads release the GIL, so DCP's one-file-per-writer-thread shards hash in parallel)."""
    from concurrent.futures import ThreadPoolExecutor
    names = list(names)
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda n: file_checksum(Path(directory) / n), names)))


def written(directory: Path, rank: int, sums: dict) -> dict:
    """`sums` ({file: {bytes, crc32}} of `rank`'s shard files, as its writer threads hashed them),
    after checking that `directory` holds exactly those files of `rank`, with those sizes."""
    found = rank_files(directory, rank)
    if sorted(sums) != found:
        raise CheckpointError(f"rank {rank} wrote {sorted(sums)} into {directory}, but finds {found} there")
    for name, s in sums.items():
        size = (Path(directory) / name).stat().st_size
        if size != s["bytes"]:
            raise CheckpointError(f"{Path(directory) / name} has {size} bytes; its writer wrote {s['bytes']}")
    return dict(sums)


def check_json(extra: dict) -> None:
    """`extra` goes into meta.json: refuse what JSON cannot hold, naming the keys."""
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        bad = [k for k, v in extra.items() if not _jsonable(v)]
        raise CheckpointError(f"extra keys {bad} cannot be saved in meta.json ({e}): pass numbers, strings, "
                              "lists and dicts (for a tensor t: t.item() or t.tolist())") from e


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def read_meta(path, *, trusted: bool = False) -> dict:
    """meta.json of a checkpoint directory, checked before any field is used: its digest (`check_sealed`;
    `trusted`: a missing one only warns), its fields and step (`check_fields`), its file list (`check_files`);
    a clear error when it or a listed file is missing."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    meta_file = path / META
    if not meta_file.is_file():
        raise CheckpointCorruptError(f"checkpoint directory {path} has no {META}: the save did not finish "
                                     "(meta.json is written last), or the directory is not a checkpoint")
    if meta_file.is_symlink():   # never read through a link: its target's text could reach an error message
        raise symlink(meta_file)
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointCorruptError(f"{meta_file} is corrupt ({e}); the checkpoint in {path} cannot be trusted") from e
    if not isinstance(meta, dict):
        raise CheckpointCorruptError(f"{meta_file} holds a JSON {type(meta).__name__}, not an object")
    for key in ("step", "world_size", "files", "fsdp"):
        if key not in meta:
            raise CheckpointCorruptError(f"{meta_file} lacks the field {key!r}; the checkpoint in {path} is incomplete")
    check_sealed(meta_file, meta, trusted=trusted)
    check_fields(path, meta)
    check_files(path, meta["files"])
    missing = [f for f in meta["files"] if not (path / f).is_file()]
    if missing:
        raise CheckpointCorruptError(f"checkpoint directory {path} is missing {len(missing)} file(s) listed in "
                                     f"{META}: {missing[:SHOWN]}")
    return meta


def seal(meta: dict) -> str:
    """The sha256 of meta.json's fields but DIGEST, as canonical JSON: meta.json's own checksum, and through
    `checksums` one over every file of the checkpoint. Not a signature (anyone who can write meta.json can
    recompute it; who may write is `trust`'s question): it catches a hand edit, a partial write, a swapped file."""
    fields = {k: v for k, v in meta.items() if k != DIGEST}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_sealed(meta_file: Path, meta: dict, *, trusted: bool = False) -> None:
    """meta.json's DIGEST matches its fields; CheckpointCorruptError before anything else of it is used. Without
    one (saved by a kit before it, or the key removed): a CheckpointError unless `trusted`, then a warning."""
    recorded = meta.get(DIGEST)
    if recorded is None:
        why = (f"{meta_file} records no {DIGEST} (a kit before issue 51 saved it, or the key was removed), so an "
               "edited step, world size or file list would load silently")
        if not trusted:
            raise CheckpointError(f"{why}. Pass trust_checkpoint=True if you trust this checkpoint, or load it so "
                                  "once and save it again (a new save records it)")
        warnings.warn(f"{why}: not verified (trust_checkpoint=True)")
        return
    if recorded != seal(meta):
        raise CheckpointCorruptError(f"{meta_file} does not match its {DIGEST} (recorded {str(recorded)[:16]}..., "
                                     f"its fields give {seal(meta)[:16]}...): meta.json was edited or damaged after the "
                                     f"save, so nothing it says (step, world size, files, checksums) can be trusted. "
                                     "Load another checkpoint (fallback=True takes the next older one)")


def check_fields(path: Path, meta: dict) -> None:
    """meta.json's layout fields hold what a save writes, and its step is the folder's (`step_000003` holds step 3)."""
    from .steps import check_step, parse_dirname
    meta_file = Path(path) / META
    try:
        check_step(meta["step"], what=f"{meta_file}: step")
    except CheckpointError as e:
        raise CheckpointError(f"{e}: a crafted or damaged meta.json; do not load this checkpoint") from None
    for key in ("world_size", "tp", "pp", "ep", "num_chunks"):
        value = meta.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "num_chunks" else 1):
            raise CheckpointError(f"{meta_file}: {key}={repr(value)[:40]} is not allowed; allowed: an int >= "
                                  f"{0 if key == 'num_chunks' else 1}. A crafted or damaged meta.json; do not load it")
    if meta.get("format", 1) not in READ_FORMATS or isinstance(meta.get("format"), bool):
        raise CheckpointError(f"{meta_file}: format={repr(meta.get('format'))[:40]} is not one this kit reads "
                              f"(allowed: {', '.join(map(str, READ_FORMATS))}); a newer kit wrote it, or meta.json was "
                              "edited: load it with the kit that saved it")
    if not isinstance(meta["fsdp"], bool) or not isinstance(meta["files"], list):
        raise CheckpointError(f"{meta_file}: fsdp={meta['fsdp']!r} / files of type {type(meta['files']).__name__} is "
                              "not allowed; allowed: fsdp true or false, files a list of names")
    folder_step = parse_dirname(Path(path).name)
    if folder_step is not None and folder_step != meta["step"]:
        raise CheckpointError(f"{meta_file} records step {meta['step']}, but its folder is {Path(path).name} (step "
                              f"{folder_step}): meta.json was edited or the folder renamed; a load would resume from "
                              "a step it did not save. Rename the folder back, or do not load this checkpoint")


def check_files(path: Path, files) -> None:
    """Every name meta.json lists is a file of the step folder itself: a plain name, and, where a symlink,
    one that stays in the folder (a load never reads a file outside it, trusted or not)."""
    folder = Path(path).resolve()
    for name in files:
        plain = isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name
        if not plain:
            raise CheckpointError(f"{Path(path) / META} lists the file {name!r}, which is not a plain file name in "
                                  f"{path}: a crafted meta.json; do not load this checkpoint")
        if (Path(path) / name).is_symlink() and (Path(path) / name).resolve().parent != folder:
            raise symlink(Path(path) / name)


def check_storage(path, metadata, files) -> None:
    """Every storage path in DCP `metadata` is a shard file (`*.distcp`) that meta.json lists (`files`)."""
    listed = {f for f in files if f.endswith(".distcp")}
    for index, info in metadata.storage_data.items():
        if info.relative_path not in listed:
            raise CheckpointError(
                f"{Path(path) / '.metadata'} stores {index.fqn} in {info.relative_path!r}, not in a shard file "
                f"meta.json lists for {path}: a crafted metadata can point a load at any file the user can read "
                "('..', absolute paths). Do not load this checkpoint")


def check_crc(file, got: str, want: dict) -> None:
    """CheckpointCorruptError naming `file` and its checkpoint when crc32 `got` is not the saved one."""
    file = Path(file)
    if got != want["crc32"]:
        raise CheckpointCorruptError(f"{file} has crc32 {got}, {want['crc32']} was saved: "
                                     f"its bytes changed since the save; checkpoint {file.parent} is damaged")


def verify(path, meta: dict, *, rank: int = 0, world: int = 1, threads: int = 4, trusted: bool = False) -> int:
    """Sizes of all files, crc32 of this rank's share (file i of meta.json's list on rank i % `world`,
    `threads` files at a time); CheckpointCorruptError naming file and checkpoint. Returns the bytes this
    rank hashed. No checksums at all: a CheckpointError unless `trusted` (trust_checkpoint=True), then a warning."""
    path = Path(path)
    recorded = meta.get("checksums")
    if recorded is None:
        why = ("saved by a kit before checksums (format 1)" if meta.get("format", 1) < 2 else
               f"format {meta.get('format')} always records them: the key was removed after the save")
        if not trusted:
            raise CheckpointError(f"{path / META} records no checksums ({why}), so damaged or swapped bytes would "
                                  "load silently. Pass trust_checkpoint=True if you trust this checkpoint's bytes, "
                                  "or load it so once and save it again (a new save records them)")
        warnings.warn(f"{path / META} records no checksums ({why}): content not verified (trust_checkpoint=True)")
        return 0
    for name in meta["files"]:
        if name not in recorded:
            raise CheckpointCorruptError(f"{path / name} has no checksum in {path / META}; the checkpoint {path} "
                                         "was altered after it was saved")
        size = (path / name).stat().st_size
        if size != recorded[name]["bytes"]:
            raise CheckpointCorruptError(f"{path / name} has {size} bytes, {recorded[name]['bytes']} were saved: "
                                         f"the file is truncated or altered; checkpoint {path} is damaged")
    mine = checksums(path, meta["files"][rank::world], threads=threads)
    for name, got in mine.items():
        check_crc(path / name, got["crc32"], recorded[name])
    return sum(got["bytes"] for got in mine.values())


def flat_keys(state: dict) -> list[str]:
    """DCP's flattened keys of `state` (what a load asks the checkpoint for)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    return sorted(flatten_state_dict(state)[0])


def check_fit(path, metadata, state: dict, *, model_prefix: str | tuple = "model.",
              asked_anywhere: set | None = None) -> None:
    """Raise before any tensor is read when `state` and the checkpoint disagree on names or shapes.

    missing: asked for, not in the checkpoint. unexpected: in the checkpoint under `model_prefix`
    (the model's own namespace; a tuple of prefixes for several), not asked for (by any rank, when
    `asked_anywhere` holds every rank's keys: expert-parallel ranks hold different experts): the
    naive load drops them silently. mismatched:
    both have it, global shapes differ (or one holds a tensor, the other a non-tensor value).
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    flat, _ = flatten_state_dict(state)
    saved = metadata.state_dict_metadata
    missing = [k for k in flat if k not in saved]
    asked = set(flat) | (asked_anywhere or set())
    unexpected = [k for k in saved if k.startswith(model_prefix) and k not in asked]
    mismatched = []
    for k, v in flat.items():
        entry = saved.get(k)
        if entry is None:
            continue
        theirs = list(entry.size) if isinstance(entry, TensorStorageMetadata) else "a non-tensor value"
        ours = list(v.shape) if torch.is_tensor(v) else "a non-tensor value"
        if theirs != ours:
            mismatched.append(f"{k}: checkpoint {theirs} vs model {ours}")
    if missing or unexpected or mismatched:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model (nothing was read): {_listing('missing from the checkpoint', missing)}"
            f"{_listing('unexpected (in the checkpoint, not in the model)', unexpected)}"
            f"{_listing('shapes differ', mismatched)}Build the model with the checkpoint's configuration "
            f"(meta.json's engine_config, hf_source), or load a checkpoint of this model")


def _listing(title: str, names: list) -> str:
    if not names:
        return ""
    more = f" (+{len(names) - SHOWN} more)" if len(names) > SHOWN else ""
    return f"{len(names)} {title}: {', '.join(names[:SHOWN])}{more}. "
