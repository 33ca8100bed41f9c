"""Checkpoints: atomic save / load of model, optimizer, scheduler, RNG, data position, yours; `to_hf`.

    ckpt = CheckpointManager("runs/ckpt", keep_last=3)
    ckpt.save(step, chunks, optimizer, scheduler, extra={"data_position": n})
    info = ckpt.load(chunks, optimizer, scheduler)          # -> meta dict, info["extra"] ...
    info = ckpt.load(chunks, optimizer, scheduler, fallback=True)   # skip damaged checkpoints

    # the same, as torch DCP Stateful components (name -> Stateful), with one of your own:
    parts = {"model": ModelState(chunks), "optimizer": OptimizerState(chunks, optimizer),
             "rng": RNGState(), "scheduler": scheduler, "data": loader}  # loader: state_dict/load_state_dict
    ckpt.save(step, parts);  ckpt.load(parts)

Layout of one checkpoint, `root/step_000010/`: torch DCP files (`*.distcp`, `.metadata`; each
tensor item the torch.save archive stock torch reads - `dcp_to_torch_save` opens a kit checkpoint
without the kit - written around the tensor's memory: `torchsave`, `rawio`; `rawread` also reads the raw
items of format 3 and DCP's own torch.save items) holding `model.<chunk>.<name>`, `optimizer...` and `rng.pp<p>_tp<t>...` tensors (and
`<name>...` of every other component that holds tensors), `scheduler.json` (`<name>.json` of every
component without tensors), and `meta.json` (written last, by rank 0: step, world size, tp/pp,
fsdp, components, kit version, engine config, file list with a crc32 and size per file, `extra`, and
`meta_sha256`, its own digest, verified before any field is used). `root/latest` names the newest one; it moves
under an flock on `root/.latest.lock`, never backwards (`steps`), and every step argument is checked at the call.

What the naive DCP save/load gets wrong, and where the kit does it differently:
- The parts are torch DCP `Stateful`s, but the kit, not DCP, calls their `state_dict` /
  `load_state_dict`, to check and mark what DCP gets in between: `components`.
- Megatron-FSDP shards are uneven and ranks hold different optimizer keys: `state`.
- A failure on one rank leaves the others waiting in a collective until the timeout: every phase
  ends in `collective.agreed`, so every rank raises the same CheckpointError within seconds;
  a failed save leaves no `.tmp-*` / `.probe-*` behind: `manager`.
- `.metadata` is a pickle: loading it can run code. The kit reads it with an allow-list
  unpickler, and refuses checkpoints that someone else could have written (owner and mode of
  every path from the root down, and `latest`; `trust_checkpoint=True` skips only the latter): `trust`.
  A save checks its root alike and creates every file new (O_EXCL | O_NOFOLLOW), so a symlink planted
  where it writes is never followed; no path in a checkpoint may be a symlink (`trust.symlink` says why).
- A crafted `.metadata` can name any file as an item's storage (`../..`, absolute paths): every storage
  path must be a shard file meta.json lists with its size and crc32 (`integrity.check_storage`).
- Bytes rot and files get truncated: crc32 per file at save, verified at load; names or shapes
  that do not match the model fail before any tensor is read: `integrity`.
- A kill mid-save must not damage the previous checkpoint: write into `.tmp-step_X`, commit by
  rename, `latest` moved last by `os.replace` (`manager`). DCP reads and writes: `storage`;
  loading one directory and `to_hf`: `restore`.

Everything the kit adds is pickle-free: meta.json and scheduler.json are JSON, RNG states are
tensors in DCP.
"""
from .components import as_components
from .errors import CheckpointCorruptError, CheckpointError
from .integrity import read_meta
from .manager import CheckpointManager, step_dirname
from .restore import load_dir, to_hf
from .state import ModelState, OptimizerState, RNGState
from .trust import check_trusted

__all__ = ["CheckpointCorruptError", "CheckpointError", "CheckpointManager", "ModelState", "OptimizerState",
           "RNGState", "as_components", "check_trusted", "load_dir", "read_meta", "step_dirname", "to_hf"]
