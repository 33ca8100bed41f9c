"""Checkpoints: atomic save / load of model, optimizer, scheduler, RNG and data position; `to_hf`.

    ckpt = CheckpointManager("runs/ckpt", keep_last=3)
    ckpt.save(step, chunks, optimizer, scheduler, extra={"data_position": n})
    info = ckpt.load(chunks, optimizer, scheduler)          # -> meta dict, info["extra"] ...

Layout of one checkpoint, `root/step_000010/`: torch DCP files (`*.distcp`, `.metadata`)
holding `model.<chunk>.<name>`, `optimizer...` and `rng.pp<p>_tp<t>...` tensors,
`scheduler.json`, and `meta.json` (written last, by rank 0: step, world size, tp/pp, fsdp,
kit version, engine config, file list, `extra`). `root/latest` names the newest one.

What is saved, per wrapper:
- Megatron-FSDP: `chunk.state_dict_for_save_checkpoint()` (DTensor shards) and the optimizer's
  `sharded_state_dict(..., distrib_optim_sharding_type="fsdp_dtensor")`. The naive DCP save of
  those deadlocks or loads wrong values: shards are uneven, and ranks hold optimizer state for
  different parameters. So every rank pads the optimizer keys it lacks with empty-local DTensors
  and sorts them (same keys, same order on every rank), and Megatron-FSDP's
  `preprocess_state_dict_for_uneven_dtensor` records each shard's true offset. After the load the
  padded entries go, `optimizer.load_state_dict` runs, and `install_optimized_model_weights()`
  copies the loaded main weights into the compute weights (without it the next forward uses the
  old weights: Megatron-Bridge #3397). Model tensors are reshardable (other DP sizes, 1 rank,
  into plain tensors for `to_hf`); optimizer state needs the same layout.
- DDP: not megatron's `dist_checkpointing` but plain torch DCP. Model tensors are replicated,
  keyed by their unwrapped names (DCP writes each once), so they reshard to any DP size and
  load into FSDP chunks. Optimizer state is per rank (`optimizer.rank<r>.*`: each inner torch
  optimizer's params and Adam state): exact, but only for the same world size and layout.
- RNG (torch CPU, CUDA when present, megatron's RNG tracker) keyed by (pp_rank, tp_rank);
  data-parallel ranks of one model-parallel rank share it (the kit seeds them alike). A
  checkpoint from another TP/PP layout skips the RNG restore and says so (a warning).

Atomic: ranks write into `root/.tmp-step_000010`; after every rank finished (errors are
all-reduced, so every rank raises), rank 0 writes `scheduler.json`, then `meta.json`, renames
the directory to `step_000010`, then writes `latest.tmp` and `os.replace`s it onto `latest`.
A save killed at any point leaves the previous checkpoint and `latest` intact. Before any
collective write rank 0 checks the root is writable and broadcasts the verdict.

Trust: torch DCP pickles its `.metadata` file (and non-tensor values such as the optimizer's
param-group table), so LOADING A CHECKPOINT CAN RUN CODE written by whoever wrote it. Load
only checkpoints you or your job wrote. `load` and `to_hf` refuse a checkpoint whose directory
or files are writable by group or others unless `trust_checkpoint=True`. Everything the kit
adds is pickle-free: meta.json and scheduler.json are JSON, RNG states are tensors in DCP.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

META = "meta.json"
SCHEDULER = "scheduler.json"
LATEST = "latest"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, untrusted or could not be written; names the path."""


def step_dirname(step: int) -> str:
    return f"step_{step:06d}"


# ---------------------------------------------------------------- small distributed helpers
def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _world() -> int:
    return dist.get_world_size() if _dist() else 1


def _broadcast(obj):
    """Rank 0's `obj` on every rank."""
    if not _dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _any_failed(error: BaseException | None) -> list[str]:
    """All-gather every rank's error (None = fine): every rank learns whether any rank failed."""
    if not _dist():
        return [f"rank 0: {error!r}"] if error else []
    errors = [None] * _world()
    dist.all_gather_object(errors, None if error is None else repr(error)[:500])
    return [f"rank {r}: {e}" for r, e in enumerate(errors) if e]


def _layout() -> dict:
    from megatron.core import parallel_state as ps
    return dict(world_size=_world(), tp=ps.get_tensor_model_parallel_world_size(),
                pp=ps.get_pipeline_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                pp_rank=ps.get_pipeline_model_parallel_rank())


# ---------------------------------------------------------------- what goes into DCP
def _canonical(name: str) -> str:
    """Parameter name without wrapper prefixes: 'module.module.decoder.x' -> 'decoder.x'."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _is_fsdp(chunks) -> bool:
    from .engine import is_fsdp
    return any(is_fsdp(c) for c in chunks)


def _model_state(chunks, *, fsdp: bool, mp_prefix: str) -> dict:
    """{chunk index: {canonical name: tensor}}: FSDP DTensor shards or DDP's full tensors.

    The values are the live parameter tensors (or DTensor views of them), so a DCP load
    writes into the model in place.
    """
    out = {}
    for i, chunk in enumerate(chunks):
        sd = chunk.state_dict_for_save_checkpoint() if hasattr(chunk, "state_dict_for_save_checkpoint") \
            else chunk.state_dict(keep_vars=True)
        out[f"{mp_prefix}{i}"] = {_canonical(k): v for k, v in sorted(sd.items())
                                  if torch.is_tensor(v) and not k.endswith("_extra_state")}
    return out


def _fsdp_optimizer_state(chunks, optimizer, model_state: dict, *, is_loading: bool) -> tuple[dict, list]:
    """The fsdp_dtensor optimizer state, padded so every rank has the same keys; (state, padded keys)."""
    from torch.distributed.tensor import DTensor
    msd = {}
    for chunk in chunks:
        msd.update(chunk.state_dict_for_save_checkpoint())
    osd = optimizer.sharded_state_dict(msd, is_loading=is_loading,
                                       metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})
    state = osd["state"]
    mine = {k: sorted(kk for kk, vv in v.items() if isinstance(vv, DTensor)) for k, v in state.items()}
    everyone = [None] * _world()
    dist.all_gather_object(everyone, mine) if _dist() else everyone.__setitem__(0, mine)
    wanted: dict[str, set] = {}
    for per_rank in everyone:
        for k, names in per_rank.items():
            wanted.setdefault(k, set()).update(names)
    by_canonical = {k: v for part in model_state.values() for k, v in part.items()}
    padded = []
    for key, names in wanted.items():
        if key in state:
            continue
        ref = by_canonical.get(_canonical(key))
        if ref is None:
            raise CheckpointError(f"optimizer key {key!r} has no model parameter {_canonical(key)!r}")
        state[key] = {n: DTensor.from_local(torch.empty(0, dtype=torch.float32, device=ref.to_local().device),
                                            device_mesh=ref.device_mesh, placements=ref.placements,
                                            shape=ref.shape, stride=ref.stride()) for n in names}
        padded.append(key)
    osd["state"] = {k: dict(sorted(state[k].items())) for k in sorted(state)}
    return osd, padded


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _ddp_optimizer_state(optimizer) -> dict:
    """This rank's optimizer tensors: each inner torch optimizer's params and Adam state.

    Adam state is created first when absent (zeros and step 0 are what Adam would start from),
    so a fresh optimizer offers the same keys to load into.
    """
    out = {}
    for i, opt in enumerate(_inner_optimizers(optimizer)):
        torch_opt = opt.optimizer
        for g, group in enumerate(torch_opt.param_groups):
            for j, p in enumerate(group["params"]):
                st = torch_opt.state[p]
                if "exp_avg" not in st:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p.data), torch.zeros_like(p.data)
                if "step" not in st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                key = f"{i}.{g}.{j}"
                out[f"{key}.param"] = p.data
                out.update({f"{key}.{n}": v for n, v in st.items() if torch.is_tensor(v)})
    return out


def _rng_key(layout: dict) -> str:
    return f"pp{layout['pp_rank']}_tp{layout['tp_rank']}"


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    out.update({f"tracker.{k}": v.clone() for k, v in get_cuda_rng_tracker().get_states().items()})
    return out


def _set_rng_state(states: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    torch.set_rng_state(states["torch_cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    tracker = {k[len("tracker."):]: v for k, v in states.items() if k.startswith("tracker.")}
    if tracker:
        get_cuda_rng_tracker().set_states(tracker)


def _write(state: dict, path: Path, *, async_save: bool = False, process_group=None, thread_count: int = 1):
    """torch DCP save (collective); with `async_save` the future of DCP's background write.

    Async: `_stage` has already copied `state` to host memory, so DCP's own stager would only copy
    it again (and its copy breaks on CPU tensors and on Megatron-FSDP's uneven shards); the
    background thread coordinates over `process_group` (gloo), never the training group.
    """
    import torch.distributed.checkpoint as dcp
    writer = dcp.FileSystemWriter(str(path), thread_count=thread_count)
    if async_save:
        return dcp.async_save(state, storage_writer=writer, process_group=process_group,
                              async_stager=_Prestaged())
    dcp.save(state, storage_writer=writer)
    return None


class _Prestaged:
    """A DCP AsyncStager for a state dict that is already a host copy: hands it over as is."""
    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _stage(state, pinned: dict, prefix: str = ""):
    """A host copy of `state` (nested dicts of tensors / DTensors) that training cannot change.

    Host buffers are pinned on CUDA and kept in `pinned` (by key) for the next save, so the copy
    is one device->host DMA per tensor. DTensors keep mesh, placements and Megatron-FSDP's
    uneven-shard metadata (attached to the local tensor), so the files are the same as a
    synchronous save's.
    """
    from torch.distributed.tensor import DTensor
    if isinstance(state, dict):
        return {k: _stage(v, pinned, f"{prefix}{k}.") for k, v in state.items()}
    if not torch.is_tensor(state):
        return state
    # _local_tensor, not to_local(): with requires_grad that is an alias without the uneven metadata.
    local = state._local_tensor if isinstance(state, DTensor) else state
    key = prefix[:-1]
    buf = pinned.get(key)
    if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
        buf = torch.empty_like(local, device="cpu", pin_memory=local.is_cuda)
        pinned[key] = buf
    buf.copy_(local.detach(), non_blocking=local.is_cuda)
    if not isinstance(state, DTensor):
        return buf
    out = DTensor.from_local(buf, device_mesh=state.device_mesh, placements=state.placements,
                             run_check=False, shape=state.shape, stride=state.stride())
    for attr in ("__create_chunk_list__", "__create_write_items__"):
        if hasattr(local, attr):
            setattr(out._local_tensor, attr, getattr(local, attr))
    return out


_GLOO_GROUPS: dict = {}


def _gloo_group():
    """A gloo group over all ranks for DCP's background coordination (created collectively, once)."""
    if not _dist():
        return None
    key = id(dist.distributed_c10d._get_default_group())
    if key not in _GLOO_GROUPS:
        _GLOO_GROUPS.clear()  # groups of a destroyed world are gone with it
        _GLOO_GROUPS[key] = dist.new_group(backend="gloo")
    return _GLOO_GROUPS[key]


# ---------------------------------------------------------------- trust and checks
def check_trusted(path: Path) -> None:
    """Refuse a checkpoint writable by group/others: its DCP metadata is unpickled on load."""
    path = Path(path)
    for p in [path, *sorted(path.iterdir())]:
        mode = p.stat().st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CheckpointError(
                f"{p} is writable by group or others (mode {stat.filemode(mode)}): loading a DCP checkpoint "
                "unpickles its metadata, which can run code. chmod go-w it, or pass trust_checkpoint=True "
                "if you trust everyone who can write there")


def read_meta(path) -> dict:
    """meta.json of a checkpoint directory; a clear error when it or a listed file is missing."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    meta_file = path / META
    if not meta_file.is_file():
        raise CheckpointError(f"checkpoint directory {path} has no {META}: the save did not finish "
                              "(meta.json is written last), or the directory is not a checkpoint")
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_file} is corrupt ({e}); the checkpoint in {path} cannot be trusted") from e
    for key in ("step", "world_size", "files", "fsdp"):
        if key not in meta:
            raise CheckpointError(f"{meta_file} lacks the field {key!r}; the checkpoint in {path} is incomplete")
    missing = [f for f in meta["files"] if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint directory {path} is missing {len(missing)} file(s) listed in "
                              f"{META}: {missing[:5]}")
    return meta


def _harden(path: Path) -> None:
    """Drop group/other write bits (so `check_trusted` accepts what we wrote). No fsync here: DCP's
    FileSystemWriter fsyncs each file it writes (sync_files=True) and `_write_json` its own."""
    for p in path.iterdir():
        p.chmod(p.stat().st_mode & ~(stat.S_IWGRP | stat.S_IWOTH))
    path.chmod(path.stat().st_mode & ~(stat.S_IWGRP | stat.S_IWOTH))


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the manager
class CheckpointManager:
    """Numbered checkpoints under `root`: atomic save, load, `latest()`, `list()`, `keep_last`.

    Every method that reads or writes tensors is collective (all ranks call it).
    """

    def __init__(self, root, *, keep_last: int | None = None, async_save: bool = False,
                 hf_source: str | None = None, write_threads: int = 4):
        """`write_threads`: file-writing threads per rank (DCP's FileSystemWriter thread_count)."""
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last={keep_last!r} is not allowed; allowed: None or an integer >= 1")
        if write_threads < 1:
            raise ValueError(f"write_threads={write_threads!r} is not allowed; allowed: an integer >= 1")
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self.write_threads = write_threads
        self._pinned: dict = {}  # host staging buffers of async saves, reused
        self.hf_source = None if hf_source is None else str(hf_source)
        self.loaded_step: int | None = None
        """The step last loaded through this manager: `keep_last` never deletes it."""
        self._pending = None
        self.last_save_s: float | None = None
        """Seconds from `save` to the commit (for async saves: to the end of `wait`)."""
        self.last_blocking_s: float | None = None
        """Seconds `save` blocked the caller (async: state + host copy; sync: everything)."""
        self.last_save_phases_s: dict = {}
        """Seconds per phase of the last save: state (build + shard metadata), stage (async host
        copy), commit (meta.json, fsync, rename, `latest`)."""
        self.last_load_s: float | None = None

    # ---- listing
    def list(self) -> list[int]:
        """Committed checkpoint steps (directories with meta.json), ascending."""
        if not self.root.is_dir():
            return []
        steps = []
        for p in self.root.iterdir():
            if p.is_dir() and p.name.startswith("step_") and (p / META).is_file():
                try:
                    steps.append(int(p.name[len("step_"):]))
                except ValueError:
                    continue
        return sorted(steps)

    def latest(self) -> int | None:
        """The step `latest` points to (None when there is no checkpoint)."""
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        name = pointer.read_text().strip()
        if not name.startswith("step_"):
            raise CheckpointError(f"{pointer} holds {name!r}, not a step directory name")
        return int(name[len("step_"):])

    def path(self, step: int) -> Path:
        return self.root / step_dirname(step)

    # ---- save
    def save(self, step: int, chunks, optimizer=None, scheduler=None, extra: dict | None = None,
             *, hf_source: str | None = None) -> Path:
        """Write checkpoint `step` (collective); returns its final directory.

        With `async_save=True` the tensors are written in the background and the commit
        (meta.json, rename, `latest`) happens in `wait()`, which the next save and `load` call.
        """
        self.wait()
        start = time.perf_counter()
        extra = dict(extra or {})
        tmp, final = self.root / f".tmp-{step_dirname(step)}", self.path(step)
        verdict = _broadcast(self._prepare(tmp, final) if _rank() == 0 else None)
        if verdict:
            raise CheckpointError(verdict)
        fsdp = _is_fsdp(chunks)
        layout = _layout()
        state, error = {}, None
        phases = self.last_save_phases_s = {}
        try:
            state = self._state(chunks, optimizer, fsdp=fsdp, layout=layout, is_loading=False)[0]
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            error = e
        self._raise_if_any(error, "building the state to save", tmp)
        phases["state"] = time.perf_counter() - start
        future = None
        try:
            if self.async_save:
                state = _stage(state, self._pinned)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # the host copies are complete before training goes on
                phases["stage"] = time.perf_counter() - start - phases["state"]
            future = _write(state, tmp, async_save=self.async_save, thread_count=self.write_threads,
                            process_group=_gloo_group() if self.async_save else None)
        except Exception as e:  # noqa: BLE001
            error = e
        self._raise_if_any(error, "writing", tmp)
        from . import runtime
        cfg = runtime.current_config() if runtime._current is not None else None
        meta = dict(format=FORMAT_VERSION, step=step, world_size=layout["world_size"], tp=layout["tp"],
                    pp=layout["pp"], fsdp=fsdp, num_chunks=len(chunks), kit_version=_kit_version(),
                    engine_config=cfg.to_dict() if cfg else None, saved_at=time.time(),
                    hf_source=hf_source or extra.get("hf_source") or self.hf_source, extra=extra,
                    time_to_write_s=None)
        sched = scheduler.state_dict() if scheduler is not None else None
        self._pending = (future, tmp, final, meta, sched, start)
        self.last_blocking_s = time.perf_counter() - start
        if future is None:
            self.wait()
        return final

    def _prepare(self, tmp: Path, final: Path) -> str | None:
        """Rank 0, before any collective write: root writable, stale tmp gone. Error text or None."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{os.getpid()}"
            probe.write_text("ok")
            probe.unlink()
            if final.exists():
                return f"checkpoint {final} already exists; save under another step or delete it first"
            if tmp.exists():  # left by a save that was killed
                shutil.rmtree(tmp)
            tmp.mkdir()
        except OSError as e:
            return f"cannot write checkpoints under {self.root}: {e}"
        return None

    def _raise_if_any(self, error, what: str, tmp: Path) -> None:
        failures = _any_failed(error)
        if failures:
            raise CheckpointError(f"checkpoint {what} failed in {tmp} on {len(failures)} rank(s): "
                                  + "; ".join(failures)) from error

    def wait(self) -> Path | None:
        """Finish a pending (async) save: wait for the writes, then commit it. Collective."""
        if self._pending is None:
            return None
        future, tmp, final, meta, sched, start = self._pending
        self._pending = None
        error = None
        try:
            if future is not None:
                future.result()
        except Exception as e:  # noqa: BLE001
            error = e
        self._raise_if_any(error, "writing (async)", tmp)
        written = time.perf_counter()
        verdict = _broadcast(self._commit(tmp, final, meta, sched, start) if _rank() == 0 else None)
        if verdict:
            raise CheckpointError(verdict)
        self.last_save_s = time.perf_counter() - start
        self.last_save_phases_s["commit"] = self.last_save_s - (written - start)
        return final

    def _commit(self, tmp: Path, final: Path, meta: dict, sched, start: float) -> str | None:
        """Rank 0: scheduler.json, meta.json (last), rename, move `latest`, prune. Error text or None."""
        try:
            if sched is not None:
                _write_json(tmp / SCHEDULER, sched)
            meta["files"] = sorted(p.name for p in tmp.iterdir())
            meta["bytes"] = sum((tmp / f).stat().st_size for f in meta["files"])
            meta["time_to_write_s"] = time.perf_counter() - start
            _write_json(tmp / META, meta)
            _harden(tmp)
            _fsync_dir(tmp)
            os.replace(tmp, final)
            pointer = self.root / f"{LATEST}.tmp"
            pointer.write_text(final.name + "\n")
            os.replace(pointer, self.root / LATEST)
            _fsync_dir(self.root)
            self._prune()
        except OSError as e:
            return f"committing checkpoint {final} failed: {e}"
        return None

    def _prune(self) -> None:
        if not self.keep_last:
            return
        steps = self.list()
        keep = set(steps[-self.keep_last:]) | {self.latest(), self.loaded_step}
        for s in steps:
            if s not in keep:
                shutil.rmtree(self.path(s), ignore_errors=True)

    # ---- load
    def load(self, chunks, optimizer=None, scheduler=None, *, step: int | str = "latest",
             trust_checkpoint: bool = False, restore_rng: bool = True) -> dict:
        """Load checkpoint `step` ("latest" or an int) into the chunks/optimizer/scheduler; return meta.

        Collective. The RNG states are restored when the checkpoint has this job's TP/PP layout;
        otherwise a warning says they were skipped. Optimizer state needs the saved wrapper and
        world size (model weights alone reshard).
        """
        self.wait()
        start = time.perf_counter()
        if step == "latest":
            step = self.latest()
            if step is None:
                raise CheckpointError(f"no checkpoint under {self.root} (no {self.root / LATEST} pointer)")
        path = self.path(int(step))
        meta = load_dir(path, chunks, optimizer, scheduler, trust_checkpoint=trust_checkpoint,
                        restore_rng=restore_rng)
        self.loaded_step = int(step)
        self.last_load_s = time.perf_counter() - start
        return meta

    def _state(self, chunks, optimizer, *, fsdp: bool, layout: dict, is_loading: bool,
               with_rng: bool = True) -> tuple[dict, list]:
        return _build_state(chunks, optimizer, fsdp=fsdp, layout=layout, is_loading=is_loading, with_rng=with_rng)


def _build_state(chunks, optimizer, *, fsdp: bool, layout: dict, is_loading: bool, with_rng: bool = True):
    """The dict handed to DCP, and the padded optimizer keys to drop after a load."""
    mp = layout["tp"] * layout["pp"] > 1 and not fsdp
    mp_prefix = f"mp_{_rng_key(layout)}." if mp else ""  # DDP with TP/PP: shards differ by model-parallel rank
    model = _model_state(chunks, fsdp=fsdp, mp_prefix=mp_prefix)
    state: dict = {"model": model}
    padded: list = []
    if optimizer is not None:
        if fsdp:
            state["optimizer"], padded = _fsdp_optimizer_state(chunks, optimizer, model, is_loading=is_loading)
        else:
            state["optimizer"] = {f"rank{_rank()}": _ddp_optimizer_state(optimizer)}
    if with_rng:
        state["rng"] = {_rng_key(layout): _rng_state()}
    if fsdp:
        _mark_uneven_shards(state)
    return state, padded


def _dtensors(state, prefix: str = "") -> list:
    from torch.distributed.tensor import DTensor
    if isinstance(state, dict):
        return [kv for k, v in state.items() for kv in _dtensors(v, f"{prefix}{k}.")]
    return [(prefix[:-1], state)] if isinstance(state, DTensor) else []


def _mark_uneven_shards(state: dict) -> None:
    """Record each DTensor shard's true offset for DCP (Megatron-FSDP shards are uneven).

    Megatron-FSDP's `preprocess_state_dict_for_uneven_dtensor` does this with one
    all_gather_object per tensor (four per parameter with Adam: ~1 s of a save on GPU). When every
    DTensor is sharded along one dim of the same 1-D mesh (Megatron-FSDP's DP mesh), one
    all_gather_object of all local shapes gives the same offsets; anything else goes to megatron's.
    """
    from megatron.core.distributed.fsdp.src.megatron_fsdp import uneven_dtensor
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.tensor import Shard
    items = _dtensors(state)
    meshes = {id(t.device_mesh) for _, t in items}
    if len(meshes) > 1 or any(t.device_mesh.ndim != 1 or type(t.placements[0]) is not Shard for _, t in items):
        uneven_dtensor.preprocess_state_dict_for_uneven_dtensor(state)
        return
    if not items:
        return
    group = items[0][1].device_mesh.get_group(0)
    shapes = [tuple(t._local_tensor.shape) for _, t in items]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, shapes, group=group)
    rank = dist.get_rank(group)
    for i, (_, t) in enumerate(items):
        dim = t.placements[0].dim
        offsets = [0] * len(shapes[i])
        offsets[dim] = sum(r[i][dim] for r in everyone[:rank])
        _attach_chunk(t, ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shapes[i])))


def _attach_chunk(t, chunk) -> None:
    """What megatron's update_uneven_dtensor_chunk_metadata attaches, for a known chunk."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    def write_items(fqn: str, tensor) -> list:
        local = tensor.to_local()
        if local.numel() == 0:
            return []
        properties = TensorProperties.create_from_tensor(local)
        return [WriteItem(type=WriteItemType.SHARD, index=MetadataIndex(fqn, chunk.offsets),
                          tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=tensor.size()))]
    t._local_tensor.__create_chunk_list__ = lambda: [chunk]
    t._local_tensor.__create_write_items__ = write_items


def load_dir(path, chunks, optimizer=None, scheduler=None, *, trust_checkpoint: bool = False,
             restore_rng: bool = True) -> dict:
    """Load one checkpoint directory (collective); see `CheckpointManager.load`."""
    import torch.distributed.checkpoint as dcp
    path = Path(path)
    meta = _checked(path, trust_checkpoint)
    fsdp = _is_fsdp(chunks)
    layout = _layout()
    same_mp = meta.get("tp") == layout["tp"] and meta.get("pp") == layout["pp"]
    if optimizer is not None and (meta["fsdp"] != fsdp or meta["world_size"] != layout["world_size"]):
        raise CheckpointError(
            f"{path}: optimizer state was saved with fsdp={meta['fsdp']}, world_size={meta['world_size']}; this "
            f"job has fsdp={fsdp}, world_size={layout['world_size']}. Load the model weights only (optimizer=None)")
    with_rng = restore_rng and same_mp
    if restore_rng and not same_mp:
        msg = (f"{path} was saved with tp={meta.get('tp')}, pp={meta.get('pp')}; this job has tp={layout['tp']}, "
               f"pp={layout['pp']}: RNG states are NOT restored (fresh RNG streams)")
        warnings.warn(msg)
        log.warning(msg)
    state, padded = _build_state(chunks, optimizer, fsdp=fsdp, layout=layout, is_loading=True, with_rng=with_rng)
    error = None
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as e:  # noqa: BLE001
        error = e
    failures = _any_failed(error)
    if failures:
        raise CheckpointError(f"loading {path} failed on {len(failures)} rank(s): " + "; ".join(failures)) from error
    if optimizer is not None:
        if fsdp:
            for key in padded:
                del state["optimizer"]["state"][key]
            optimizer.load_state_dict(state["optimizer"])
        # DDP: the optimizer tensors were loaded in place.
    if fsdp:
        from .engine import is_fsdp
        for chunk in chunks:
            if is_fsdp(chunk):
                chunk.module.install_optimized_model_weights()
    if with_rng:
        _set_rng_state(state["rng"][_rng_key(layout)])
    if scheduler is not None:
        sched_file = path / SCHEDULER
        if not sched_file.is_file():
            raise CheckpointError(f"{path} has no {SCHEDULER}, but a scheduler was passed to load")
        scheduler.load_state_dict(json.loads(sched_file.read_text()))
    meta["rng_restored"] = with_rng
    return meta


def _checked(path: Path, trust_checkpoint: bool) -> dict:
    meta = read_meta(path)
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint directory {path} has no DCP .metadata file")
    if not trust_checkpoint:
        check_trusted(path)
    return meta


# ---------------------------------------------------------------- to Hugging Face
def to_hf(checkpoint_dir, out_dir, hf_source=None, *, trust_checkpoint: bool = False) -> Path:
    """Convert a checkpoint's model weights to an HF folder, on CPU, in this one process.

    Builds the model from the HF source folder (`hf_source`, else the one meta.json records)
    at world size 1 through Megatron-Bridge, loads the weights from DCP (any saved world size;
    DTensor shards are read into plain tensors), then `sync.save_hf`. Starts a 1-rank world
    when none exists.
    """
    import torch.distributed.checkpoint as dcp
    from . import engine, runtime, sync
    from .config import EngineConfig
    from .models import hf as hf_models
    checkpoint_dir = Path(checkpoint_dir)
    meta = _checked(checkpoint_dir, trust_checkpoint)
    hf_source = hf_source or meta.get("hf_source")
    if not hf_source:
        raise CheckpointError(f"{checkpoint_dir / META} records no hf_source; pass hf_source= (the HF folder "
                              "the model was loaded from)")
    if meta.get("tp", 1) * meta.get("pp", 1) > 1 and not meta.get("fsdp"):
        raise CheckpointError(f"{checkpoint_dir}: to_hf reads DDP checkpoints saved with tp=pp=1 only "
                              f"(this one: tp={meta.get('tp')}, pp={meta.get('pp')})")
    saved = meta.get("engine_config") or {}
    cfg = EngineConfig(dtype=saved.get("dtype", "fp32"), seed=saved.get("seed", 1234))
    if _dist() and _world() > 1:
        raise CheckpointError(f"to_hf runs in a single process; this one is rank {_rank()} of {_world()}")
    started = not _dist()
    if started:  # a private 1-rank world: an in-memory store, no port, no launcher's rendezvous
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    runtime.init(cfg, rank=0, world_size=1, local_rank=0)
    try:
        bridge, provider = hf_models.provider(hf_source, cfg)
        chunks = engine.build(cfg, provider, wrap=False)
        layout = _layout()
        state = {"model": _model_state(chunks, fsdp=False, mp_prefix="")}
        if meta.get("num_chunks", 1) != len(chunks):
            raise CheckpointError(f"{checkpoint_dir} holds {meta.get('num_chunks')} model chunks; "
                                  f"the rebuilt model has {len(chunks)} (layout {layout})")
        dcp.load(state, checkpoint_id=str(checkpoint_dir))
        return sync.save_hf(chunks, bridge, out_dir)
    finally:
        if started:
            runtime.shutdown(destroy_process_group=True)


def _kit_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("mfsdp_kit")
    except PackageNotFoundError:
        return "unknown"
