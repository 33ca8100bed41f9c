"""Reading one checkpoint directory back: into a running job (`load_dir`) or into an HF folder (`to_hf`).

`load_dir` runs four phases, each ending in `collective.agreed` (a failure anywhere raises the
same CheckpointError everywhere):
1. checks that need no model (`checked`): meta.json, listed files, trust, checksums (each rank
   its share), the DCP metadata through the allow-list unpickler, scheduler.json;
2. the job's layout against the saved one (optimizer state needs the same wrapper and world size);
3. the state to load into (`state.build_state`), then `integrity.check_fit` against the DCP
   metadata - names and shapes - still before any tensor is read;
4. the DCP read (`storage.read`), then the optimizer, Megatron-FSDP's compute weights, RNG, scheduler.
"""
from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

from . import collective, integrity, state, storage, trust
from .collective import agreed
from .errors import CheckpointCorruptError, CheckpointError

log = logging.getLogger(__name__)

SCHEDULER = "scheduler.json"
DCP_METADATA = ".metadata"


def checked(path, trust_checkpoint: bool, *, root=None, rank: int = 0, world: int = 1):
    """(meta, DCP metadata) of a checkpoint that passed every check needing no model. Local.

    Trust (unless `trust_checkpoint`), meta.json and its file list, checksums (crc32 of files
    rank::world), then `.metadata` through `trust.load_metadata` (never runs code it contains).
    """
    path = Path(path)
    meta = integrity.read_meta(path)
    if not (path / DCP_METADATA).is_file():
        raise CheckpointCorruptError(f"checkpoint directory {path} has no DCP {DCP_METADATA} file")
    if not trust_checkpoint:
        trust.check_trusted(path, root=root)
    integrity.verify(path, meta, rank=rank, world=world)
    return meta, trust.load_metadata(path / DCP_METADATA)


def _scheduler_state(path: Path) -> dict:
    sched_file = path / SCHEDULER
    if not sched_file.is_file():
        raise CheckpointError(f"{path} has no {SCHEDULER}, but a scheduler was passed to load")
    try:
        return json.loads(sched_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{sched_file} is corrupt ({e})") from e


def _model_prefix(fsdp: bool, layout: dict) -> str:
    """The DCP key prefix of this rank's model tensors (what `check_fit` calls unexpected under)."""
    mp = layout["tp"] * layout["pp"] > 1 and not fsdp
    return f"model.mp_{state.rng_key(layout)}." if mp else "model."


def _compatible(path: Path, meta: dict, optimizer, fsdp: bool, layout: dict, restore_rng: bool) -> bool:
    """Raise when the optimizer state cannot load here; return whether the RNG states will."""
    if optimizer is not None and (meta["fsdp"] != fsdp or meta["world_size"] != layout["world_size"]):
        raise CheckpointError(
            f"{path}: optimizer state was saved with fsdp={meta['fsdp']}, world_size={meta['world_size']}; this "
            f"job has fsdp={fsdp}, world_size={layout['world_size']}. Load the model weights only (optimizer=None)")
    same_mp = meta.get("tp") == layout["tp"] and meta.get("pp") == layout["pp"]
    if restore_rng and not same_mp:
        msg = (f"{path} was saved with tp={meta.get('tp')}, pp={meta.get('pp')}; this job has tp={layout['tp']}, "
               f"pp={layout['pp']}: RNG states are NOT restored (fresh RNG streams)")
        warnings.warn(msg)
        log.warning(msg)
    return restore_rng and same_mp


def load_dir(path, chunks, optimizer=None, scheduler=None, *, trust_checkpoint: bool = False,
             restore_rng: bool = True, root=None) -> dict:
    """Load one checkpoint directory (collective); see `CheckpointManager.load` and the module docstring."""
    path = Path(path)
    with agreed("checking checkpoint", path):
        meta, metadata = checked(path, trust_checkpoint, root=root, rank=collective.rank(), world=collective.world())
        sched_state = _scheduler_state(path) if scheduler is not None else None
    with agreed("checking the layout for checkpoint", path):
        fsdp, layout = state.is_fsdp(chunks), state.layout()
        with_rng = _compatible(path, meta, optimizer, fsdp, layout, restore_rng)
    with agreed("matching the model to checkpoint", path):
        into, padded = state.build_state(chunks, optimizer, fsdp=fsdp, layout=layout, is_loading=True,
                                         with_rng=with_rng)
        integrity.check_fit(path, metadata, into, model_prefix=_model_prefix(fsdp, layout))
    with agreed("loading checkpoint", path):
        storage.read(into, path)
    with agreed("restoring checkpoint", path):
        _install(into, padded, chunks, optimizer, fsdp=fsdp)
        if with_rng:
            state.set_rng_state(into["rng"][state.rng_key(layout)])
        if scheduler is not None:
            scheduler.load_state_dict(sched_state)
    meta["rng_restored"] = with_rng
    return meta


def _install(loaded: dict, padded: list, chunks, optimizer, *, fsdp: bool) -> None:
    """After the DCP read: FSDP optimizer state in, and the main weights copied to the compute weights.

    DDP's optimizer tensors were loaded in place. Megatron-FSDP needs `optimizer.load_state_dict`
    (without the padded keys) and `install_optimized_model_weights()`: without it the next
    forward still uses the old compute weights (Megatron-Bridge #3397).
    """
    if optimizer is not None and fsdp:
        for key in padded:
            del loaded["optimizer"]["state"][key]
        optimizer.load_state_dict(loaded["optimizer"])
    if fsdp:
        from ..engine import is_fsdp
        for chunk in chunks:
            if is_fsdp(chunk):
                chunk.module.install_optimized_model_weights()


# ---------------------------------------------------------------- to Hugging Face
def to_hf(checkpoint_dir, out_dir, hf_source=None, *, trust_checkpoint: bool = False) -> Path:
    """Convert a checkpoint's model weights to an HF folder, on CPU, in this one process.

    Builds the model from the HF source folder (`hf_source`, else the one meta.json records)
    at world size 1 through Megatron-Bridge, checks names and shapes against the checkpoint, loads
    the weights from DCP (any saved world size; DTensor shards are read into plain tensors), then
    `sync.save_hf`. Starts a 1-rank world when none exists.
    """
    import torch.distributed as dist

    from .. import engine, runtime, sync
    from ..config import EngineConfig
    from ..models import hf as hf_models
    checkpoint_dir = Path(checkpoint_dir)
    meta, metadata = checked(checkpoint_dir, trust_checkpoint)
    hf_source = hf_source or meta.get("hf_source")
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
        into = {"model": state.model_state(chunks, fsdp=False, mp_prefix="")}
        integrity.check_fit(checkpoint_dir, metadata, into)
        with agreed("loading checkpoint", checkpoint_dir):  # one rank: wraps DCP's CheckpointException
            storage.read(into, checkpoint_dir)
        return sync.save_hf(chunks, bridge, out_dir)
    finally:
        if started:
            runtime.shutdown(destroy_process_group=True)
