"""Reading one checkpoint directory back: into a running job (`load_dir`) or into an HF folder (`to_hf`).

`load_dir` runs in phases, each ending in `collective.agreed` (a failure anywhere raises the same
CheckpointError everywhere):
1. checks that need no model (`checked`): meta.json, listed files and their sizes, trust, the
   crc32 of every file, shard files included (each rank its share: file i on rank i % world size),
   the DCP metadata through the allow-list unpickler;
2. the job's layout against the saved one, through each component's `accepts` (optimizer state
   needs the same wrapper and TP/PP/EP, DDP's also the world size; RNG the same TP/PP layout, else it is skipped);
3. the state to load into (`components.collect`: each component's state dict; JSON components
   from `<name>.json`), then `integrity.check_fit` against the DCP metadata - names and shapes -
   still before any tensor is read;
4. the DCP read (`storage.read`), then each component's `load_state_dict`, in the dict's order
   (the optimizer, Megatron-FSDP's compute weights, RNG, scheduler, yours).
Every check comes before the first tensor is read, so a load they refuse leaves the job's tensors as they
were. DCP reads into the model's own tensors: a crc32 of each shard file taken while reading it (the bytes
read once) found damage only after the files read before it, and the damaged file's bytes before the
damage, had landed in the model. Checked first, each shard file's bytes are read twice, the second time
from the page cache the check filled (the cost: docs/checkpoint.md); loading into spare buffers and
swapping would hold a second copy of the whole state in memory instead.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from ..distributed.stopwatch import Stopwatch
from . import collective, integrity, state, storage, trust
from . import components as parts
from .collective import agreed
from .errors import CheckpointCorruptError, CheckpointError

DCP_METADATA = ".metadata"


def checked(path, trust_checkpoint: bool, *, root=None, rank: int = 0, world: int = 1, threads: int = 4,
            phases: dict | None = None):
    """(meta, DCP metadata) of a checkpoint that passed every check needing no model. Local.

    Trust (unless `trust_checkpoint`), meta.json and its file list, checksums (sizes of all files, crc32
    of files rank::world, shard files included), then `.metadata` through `trust.load_metadata` (never
    runs code it contains), whose storage paths must all be shard files meta.json lists
    (`integrity.check_storage`). `phases` (a dict) gets `check.checksum`: this rank's seconds of crc32.
    """
    path = Path(path)
    meta = integrity.read_meta(path, trusted=trust_checkpoint)
    if not (path / DCP_METADATA).is_file():
        raise CheckpointCorruptError(f"checkpoint directory {path} has no DCP {DCP_METADATA} file")
    if not trust_checkpoint:
        trust.check_trusted(path, root=root)
    start = time.perf_counter()
    integrity.verify(path, meta, rank=rank, world=world, threads=threads, trusted=trust_checkpoint)
    if phases is not None:
        phases["check.checksum"] = time.perf_counter() - start
    metadata = trust.load_metadata(path / DCP_METADATA)
    integrity.check_storage(path, metadata, meta["files"])
    return meta, metadata


def json_state(path: Path, name: str, files) -> dict:
    """The state of a JSON component, `<name>.json` (`scheduler.json` for the scheduler), one of `files`
    (meta.json's list: only a listed file has a checksum)."""
    file = path / f"{name}.json"
    if not file.is_file() or file.name not in files:
        raise CheckpointError(f"{path} has no {file.name}, but a component {name!r} was passed to load")
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{file} is corrupt ({e})") from e


def load_dir(path, components, optimizer=None, scheduler=None, *, trust_checkpoint: bool = False,
             restore_rng: bool = True, root=None, read_threads: int = 4, phases: dict | None = None,
             watch: Stopwatch | None = None) -> dict:
    """Load one checkpoint directory into `components` (a dict of name -> Stateful, or model chunks
    with `optimizer` / `scheduler`: see `components.as_components`). Collective; see
    `CheckpointManager.load` and the module docstring. Returns meta.json's dict, plus
    `rng_restored` and `restored` (the component names loaded). `phases` (a dict) gets the seconds of check,
    match, read and restore, check's crc32 as `check.checksum` and read's parts as `read.<part>`
    (`storage.read`); `watch` (a `Stopwatch`, the caller's, so its phases continue one run of marks:
    `CheckpointManager.load`) gets them instead."""
    path = Path(path)
    watch = watch or Stopwatch(phases)
    phases, lap = watch.phases, watch.lap
    components = parts.as_components(components, optimizer, scheduler, rng=restore_rng)
    with agreed("checking checkpoint", path):
        parts.check(components)
        meta, metadata = checked(path, trust_checkpoint, root=root, rank=collective.rank(), world=collective.world(),
                                 threads=read_threads, phases=phases)
    lap("check")
    with agreed("checking the layout for checkpoint", path):
        active = parts.accepted(components, meta, path, restore_rng=restore_rng)
    with agreed("matching the model to checkpoint", path):
        into, from_json = parts.collect(active, loading=True)
        state.mark_uneven_shards(into)
        from_json = {name: json_state(path, name, meta["files"]) for name in from_json}
    # Expert-parallel ranks each ask for their own experts: a key is unexpected when no rank asks for it.
    asked = set().union(*collective.all_gather(integrity.flat_keys(into)))
    with agreed("matching the model to checkpoint", path):
        integrity.check_fit(path, metadata, into, model_prefix=parts.strict_prefixes(active), asked_anywhere=asked)
    lap("match")
    reading: dict = {}
    with agreed("loading checkpoint", path):
        if into:   # every file's crc32 was checked in "check", on every rank's say: none is damaged
            storage.read(into, path, threads=read_threads, phases=reading, files=meta["files"])
    lap("read")
    if reading:
        reading["wait_peers"] = phases["read"] - reading["plan"] - reading["data"] - reading["finish"]
    phases.update({f"read.{k}": v for k, v in reading.items()})
    with agreed("restoring checkpoint", path):
        for name, comp in active.items():
            parts.load(comp, into[name] if name in into else from_json[name])
    lap("restore")
    meta["rng_restored"] = any(isinstance(c, state.RNGState) for c in active.values())
    meta["restored"] = list(active)
    return meta


# ---------------------------------------------------------------- to Hugging Face
def to_hf(checkpoint_dir, out_dir, hf_source=None, *, trust_checkpoint: bool = False) -> Path:
    """Convert a checkpoint's model weights to an HF folder, on CPU, in this one process.

    Builds the model from the HF source folder (`hf_source`, else the one meta.json records)
    at world size 1 through Megatron-Bridge, checks names and shapes against the checkpoint, loads
    the weights from DCP (any saved world size; DTensor shards are read into plain tensors), then
    `sync.save_hf`. Starts a 1-rank world when none exists.
    """
    import torch.distributed as dist

    from ..distributed import engine, runtime
    from ..weights import sync
    from ..config import EngineConfig
    from ..models import hf as hf_models
    checkpoint_dir = Path(checkpoint_dir)
    meta, metadata = checked(checkpoint_dir, trust_checkpoint)
    hf_source = hf_source or meta.get("hf_source")
    if meta.get("lora_base"):
        raise CheckpointError(f"{checkpoint_dir} holds LoRA adapters only (base: {meta['lora_base']['path']}): load "
                              "the base with EngineConfig.lora and this checkpoint, then sync.save_hf (merged) or "
                              "adapters.save_adapter")
    if not hf_source:
        raise CheckpointError(f"{checkpoint_dir / integrity.META} records no hf_source; pass hf_source= (the HF "
                              "folder the model was loaded from)")
    if meta.get("tp", 1) * meta.get("pp", 1) > 1 and not meta.get("fsdp"):
        raise CheckpointError(f"{checkpoint_dir}: to_hf reads DDP checkpoints saved with tp=pp=1 only "
                              f"(this one: tp={meta.get('tp')}, pp={meta.get('pp')})")
    saved = meta.get("engine_config") or {}
    cfg = EngineConfig(dtype=saved.get("dtype", "fp32"), seed=saved.get("seed", 1234))
    if collective.initialized() and collective.world() > 1:
        raise CheckpointError(f"to_hf runs in a single process; this one is rank {collective.rank()} of "
                              f"{collective.world()}")
    started = not collective.initialized()
    if started:  # a private 1-rank world: an in-memory store, no port, no launcher's rendezvous
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    runtime.init(cfg, rank=0, world_size=1, local_rank=0)
    try:
        bridge, provider = hf_models.provider(hf_source, cfg)
        chunks = engine.build(cfg, provider, wrap=False)
        if meta.get("num_chunks", 1) != len(chunks):
            raise CheckpointError(f"{checkpoint_dir} holds {meta.get('num_chunks')} model chunks; "
                                  f"the rebuilt model has {len(chunks)} (layout {state.layout()})")
        into = {"model": state.ModelState(chunks).state_dict()}
        integrity.check_fit(checkpoint_dir, metadata, into)
        with agreed("loading checkpoint", checkpoint_dir):  # one rank: wraps DCP's CheckpointException
            storage.read(into, checkpoint_dir, files=meta["files"])
        return sync.save_hf(chunks, bridge, out_dir)
    finally:
        if started:
            runtime.shutdown(destroy_process_group=True)
