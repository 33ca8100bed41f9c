"""`CheckpointManager`: numbered checkpoints under a root; atomic save, checked load, fallback.

A save runs in phases, each ending in `collective.agreed`: a failure on any rank raises the same
CheckpointError on every rank at once, and rank 0 then removes `.tmp-step_X` (the probe file
never outlives its check), so a failed save leaves nothing behind and the next one starts clean.

1. every rank: `extra` must be JSON (it goes into meta.json), the components' names are allowed,
   and every rank passes the same names - checked before anything is written.
2. rank 0 (`commit.prepare`): the root is trusted as a load's is (`trust.check_save`: owner, mode, no
   symlink) and writable (a probe file), the step is new and not below `latest`, a stale `.tmp-step_X`
   goes. Every file a save creates is new (O_EXCL | O_NOFOLLOW): a planted symlink is never followed.
3. every rank: each component's state dict (`components.collect`), uneven shards marked.
4. every rank: DCP writes the shards into `.tmp-step_X` (async: in the background, and steps 4's
   end and 5 run in `wait()`), each tensor a torch.save archive written around its memory (`rawio`,
   `torchsave`: stock torch reads it); its writer threads crc32
   each file's bytes as they write them (`storage.HashingFileSystem`), so no file is read back.
5. rank 0 commits (`commit`): meta.json last, rename to `step_X`, then `latest`; steps beyond
   `keep_last` are renamed away and deleted in the background.

A load resolves the step (following `latest` only after `trust.check_path` accepted it; all ranks
must resolve the same step), then `restore.load_dir`. With `fallback=True` a checkpoint whose
bytes are damaged (CheckpointCorruptError: found before any tensor is read) is skipped for the
next older one; a warning and the returned meta's `fallback_from` say which were skipped.
"""
from __future__ import annotations

import functools
import logging
import os
import time
import warnings
from pathlib import Path

import torch

from .. import folders
from ..distributed import stop
from ..distributed.stopwatch import Stopwatch
from . import collective, integrity, restore, state, steps, storage, trust
from . import commit as committing
from . import components as parts
from .collective import agreed
from .errors import CheckpointCorruptError, CheckpointError
from .steps import step_dirname

log = logging.getLogger(__name__)

LATEST = committing.LATEST
FORMATS = {"standard": 4, "raw": 3, "torch_save": 2}
"""meta.json's `format` a `tensor_format` writes. 1: no checksums. 2: meta.json's `checksums` ({file: {bytes,
crc32}}), tensor items DCP's torch.save. 3: tensor items their raw bytes (only the kit reads them). 4: tensor
items torch.save archives written around the tensors' memory (`torchsave`): stock torch reads them, at
format 3's speed. Every version loads."""
FORMAT_VERSION = FORMATS["standard"]
TENSOR_FORMATS = tuple(FORMATS)


class CheckpointManager:
    """Numbered checkpoints under `root`: atomic save, load, `latest()`, `list()`, `keep_last`.

    Every method that reads or writes tensors is collective (all ranks call it).
    """

    def __init__(self, root, *, keep_last: int | None = None, async_save: bool = False,
                 hf_source: str | None = None, write_threads: int | None = None, read_threads: int | None = None,
                 host_staging: bool = False, tensor_format: str = "standard"):
        """`write_threads`: file-writing threads per rank (DCP's FileSystemWriter thread_count), each
        writing its own file; `read_threads`: threads per rank reading those files at load. None: `io_threads()`.
        `host_staging`: a synchronous save first copies the state into host buffers kept for the
        next save (pinned on CUDA: one DMA per tensor, all in flight at once), as async saves always
        do (training must not change what is written). Without it the writer threads copy each GPU
        tensor through a 64 MiB pinned buffer, one blocking copy at a time. The cost: the host holds
        one more copy of this rank's checkpoint bytes for the manager's life (pinned on CUDA).
        Off by default: once the prune left the commit, the staged sync save was the slower one with 4 and
        with 8 threads (an earlier 2-GPU run, the prune inside the commit, had favoured staging; measured:
        docs/benchmarks.md, checkpoint, "Every second attributed"); on CPU it only adds a copy.
        `tensor_format`: "standard" (each tensor a torch.save archive, as DCP's own writer makes them, written
        around the tensor's memory: `torchsave`; stock torch's `FileSystemReader` and `dcp_to_torch_save` read
        it), "raw" (each tensor's bytes alone, format 3: torch's reader refuses them) or "torch_save" (DCP's own
        torch.save per tensor, the slow writer of format 2); loads read all of them."""
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last={keep_last!r} is not allowed; allowed: None or an integer >= 1")
        for name, value in (("write_threads", write_threads), ("read_threads", read_threads)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} is not allowed; allowed: None or an integer >= 1")
        if tensor_format not in TENSOR_FORMATS:
            raise ValueError(f"tensor_format={tensor_format!r} is not allowed; allowed: {', '.join(TENSOR_FORMATS)}")
        self.tensor_format = tensor_format
        self.root = Path(root)
        self.keep_last = keep_last
        self.async_save = async_save
        self.host_staging = host_staging
        self.write_threads = write_threads or io_threads()
        self.read_threads = read_threads or io_threads()
        self._pinned: dict = {}  # host staging buffers, reused
        self._remover = committing.Remover()
        self.hf_source = None if hf_source is None else str(hf_source)
        self.loaded_step: int | None = None
        """The step last loaded through this manager: `keep_last` never deletes it."""
        self._pending = None
        self.last_save_s: float | None = None
        """Seconds from `save` to the commit (for async saves: to the end of `wait`)."""
        self.last_blocking_s: float | None = None
        """Seconds `save` blocked the caller (async: state + host copy; sync: everything)."""
        self.last_save_phases_s: dict = {}
        """Seconds per phase of the last save on this rank; state + stage + write + commit = the save.
        state: checks, the components' state dicts, shard metadata, meta.json's fields. stage: the
        host copy (async or `host_staging`). write: from DCP's start until this rank's files are
        written (async: until the background write is done), its parts `write.plan` (DCP's planning
        and its collectives), `write.data` (the writer threads), `write.finish` (DCP's result gather;
        rank 0 writes `.metadata`), `write.rest`; an async save blocks the caller for state, stage,
        `write.submit` (handing the staged state to DCP's background thread; `write.plan` then runs
        there) and `write.submit_wait_peers` (the slowest rank's staging). Per file (mean over this
        rank's files): serialise (DCP's per-item lookup, device->host copies; with
        tensor_format="torch_save" also torch.save), checksum (crc32), file_write (copies into the
        page cache), fsync; `write.slowest_file`: its wall seconds.
        commit: from this rank's files written until the checkpoint is `latest`, its parts
        `commit.wait_peers` (the slowest rank's write), rank 0's `commit.files` (JSON files, the
        small files' crc32, meta.json), `commit.sync` (fsyncs, write bits), `commit.publish`
        (rename, `latest`), `commit.prune` (renaming old steps away; deleted in the background),
        and `commit.agree` (the rest: the other ranks wait for rank 0 there)."""
        self.last_load_s: float | None = None
        self.last_load_phases_s: dict = {}
        """Seconds per phase of the last load: find (the step to load; with `fallback`, the tries of damaged steps
        too), check (trust, sizes, crc32 of this rank's share of the files, shard files included:
        `check.checksum`; DCP metadata), match (layout, state to load into, names and shapes), read
        (DCP: file reads straight into the state, `read_threads` files at a time), restore (the
        components' load_state_dict). read's parts:
        `read.plan`, `read.data` (the reader threads), `read.finish`, `read.wait_peers`; per file
        (mean) `read.file_read`, `read.copy` (host->device on GPU), `read.other`;
        `read.slowest_file` (wall)."""

    # ---- listing
    def list(self) -> list[int]:
        """Committed checkpoint steps (directories with meta.json), ascending."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            step = steps.parse_dirname(p.name)   # `step_%06d` only: no `step_-1`, `step_3`, 5000 digits
            if step is not None and p.is_dir() and (p / integrity.META).is_file():
                found.append(step)
        return sorted(found)

    def latest(self) -> int | None:
        """The step `latest` points to (None when there is no checkpoint); a symlink there is refused unread."""
        return steps.read_latest(self.root)

    def path(self, step: int) -> Path:
        """The folder of `step` (an int >= 0: `steps.check_step`)."""
        return self.root / step_dirname(step)

    # ---- save
    @stop.stoppable(then_interrupt="a checkpoint save")   # a notebook's Stop: the step is committed whole first
    def save(self, step: int, components, optimizer=None, scheduler=None, extra: dict | None = None,
             *, hf_source: str | None = None, trust_checkpoint: bool = False, allow_backwards: bool = False) -> Path:
        """Write checkpoint `step` (collective); returns its final directory.

        `components`: a dict of name -> Stateful ({"model": ModelState(chunks), "optimizer":
        OptimizerState(chunks, opt), "rng": RNGState(), "scheduler": sched, ...yours}), or the
        model chunks, with `optimizer` and `scheduler` (the same dict, built for you: RNG included).
        `extra`: JSON values for meta.json (the data position, say). With `async_save=True` the
        tensors are written in the background and the commit (meta.json, rename, `latest`)
        happens in `wait()`, which the next save and `load` call. Refused before anything is written: a `step`
        that is not an int >= 0 (`steps.check_step`: no bool, str, float or None), a
        root (or `latest`, the step's folder) that another user could have written or that is a symlink, as a
        load refuses it (`trust_checkpoint=True` skips this; no file is ever written through a symlink), and a
        step below `latest` unless `allow_backwards=True` (the next load would resume from it); the commit
        checks that again under the root's lock (`steps.publish`), so a concurrent saver's later step refuses it.
        """
        self.wait()
        watch = Stopwatch()   # one run of marks: the phases sum to last_save_s exactly
        self.last_save_phases_s = watch.phases
        components = parts.as_components(components, optimizer, scheduler)
        extra = dict(extra or {})
        with agreed("saving a checkpoint under", self.root) as mine:
            step = steps.check_step(step)   # before anything is written: no bool, str, float, None
            integrity.check_json(extra)
            parts.check(components)
            mine.value = list(components)
        tmp, final = self.root / f".tmp-{step_dirname(step)}", self.path(step)
        if any(v != mine.values[0] for v in mine.values):
            raise CheckpointError(f"ranks passed different components to save {final}: "
                                  + ", ".join(f"rank {r}: {v}" for r, v in enumerate(mine.values)))
        with agreed("preparing checkpoint", final):
            verdict = committing.prepare(self.root, tmp, final, trust_checkpoint=trust_checkpoint,
                                         allow_backwards=allow_backwards) if collective.rank() == 0 else None
            if verdict:
                raise CheckpointError(verdict)
        fs = storage.HashingFileSystem()
        try:
            to_save, as_json, formats = self._collect(components, tmp)
            meta = self._meta(step, components, formats, extra, hf_source)
            watch.lap("state")
            future = self._write(to_save, tmp, fs, watch)
        except CheckpointError:
            self._discard(tmp)
            raise
        self._pending = (future, fs, tmp, final, meta, as_json, watch, allow_backwards)
        if future is None:
            self.wait()
        self.last_blocking_s = watch.total()
        return final

    def _collect(self, components: dict, tmp: Path):
        """Phase 3: the states to save; (DCP's state, the JSON components' states, {name: format})."""
        with agreed("building the state of checkpoint", tmp) as mine:
            to_save, as_json = parts.collect(components, loading=False)
            state.mark_uneven_shards(to_save)
            mine.value = parts.formats(to_save, as_json)
        formats = mine.values[0]
        if any(v != formats for v in mine.values):  # a component with tensors on one rank only
            raise CheckpointError(f"ranks disagree on where the components of {tmp} go (DCP or JSON): "
                                  + ", ".join(f"rank {r}: {v}" for r, v in enumerate(mine.values)))
        return to_save, as_json, formats

    def _write(self, to_save: dict, tmp: Path, fs: storage.HashingFileSystem, watch: Stopwatch):
        """Phase 4: stage (async or `host_staging`), hand the tensors to DCP; its future (async) or None.
        The write phase runs from here (or the stage's end) to `wait`'s `write` lap. Async phases that
        block the caller: stage, write.submit (DCP takes the state), write.submit_wait_peers (the slowest
        rank's staging)."""
        with agreed("writing checkpoint", tmp):
            if self.async_save or self.host_staging:
                to_save = storage.stage(to_save, self._pinned)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()  # the host copies are complete before training goes on
                watch.lap("stage")
            write_start = watch.last
            future = storage.write(to_save, tmp, async_save=self.async_save, thread_count=self.write_threads,
                                   process_group=collective.gloo_group() if self.async_save else None, fs=fs,
                                   tensor_format=self.tensor_format)
            submitted = time.perf_counter()
        if self.async_save:
            watch.phases["write.submit"] = submitted - write_start
            watch.phases["write.submit_wait_peers"] = time.perf_counter() - submitted
        return future

    def _meta(self, step: int, components: dict, formats: dict, extra: dict, hf_source) -> dict:
        """meta.json's fields; `fsdp` and `num_chunks` describe the model component (`components.model`)."""
        from ..distributed import runtime
        layout = state.layout()
        model = parts.model(components)
        cfg = runtime.current_config() if runtime._current is not None else None
        return dict(format=FORMATS[self.tensor_format], step=step, world_size=layout["world_size"], tp=layout["tp"],
                    pp=layout["pp"], ep=layout["ep"], fsdp=bool(model and model.fsdp), num_chunks=len(model.chunks) if model else 0,
                    lora_base=model.lora_base if model else None,
                    components=formats, kit_version=_kit_version(),
                    engine_config=cfg.to_dict() if cfg else None, saved_at=time.time(),
                    hf_source=hf_source or extra.get("hf_source") or self.hf_source, extra=extra,
                    time_to_write_s=None)

    def _discard(self, tmp: Path) -> None:
        """Rank 0, after every rank agreed the save failed: its partial files go."""
        if collective.rank() == 0:
            folders.discard(tmp)

    @stop.stoppable(then_interrupt="a checkpoint save")
    def wait(self) -> Path | None:
        """Finish a pending (async) save: wait for the writes, checksum, commit. Collective."""
        if self._pending is None:
            return None
        future, fs, tmp, final, meta, as_json, watch, allow_backwards = self._pending
        self._pending = None
        phases, parts_s, write_start = watch.phases, {}, watch.last
        try:
            with agreed("writing checkpoint", tmp) as mine:
                if future is not None:
                    future.result()
                written = watch.lap("write")
                mine.value = integrity.written(tmp, collective.rank(), fs.sums)
            peers = time.perf_counter()
            sums = {name: s for per_rank in mine.values for name, s in per_rank.items()}
            with agreed("committing checkpoint", final):
                if collective.rank() == 0:
                    parts_s = committing.commit(tmp, final, meta, as_json, sums, start=watch.start,
                                                allow_backwards=allow_backwards)
                    parts_s["prune"] = self._prune()
        except CheckpointError:
            self._discard(tmp)
            raise
        watch.lap("commit")
        self.last_save_s = watch.lapped()
        phases.update(fs.write_phases(write_start, written))
        phases["commit.wait_peers"] = peers - written
        phases.update({f"commit.{k}": v for k, v in parts_s.items()})
        phases["commit.agree"] = phases["commit"] - sum(v for k, v in phases.items() if k.startswith("commit."))
        return final

    def close(self) -> None:
        """Finish a pending save (collective) and wait until pruned checkpoints are deleted (they
        are gone from `list()` at once; their files go in the background)."""
        self.wait()
        self._remover.wait()

    def _prune(self) -> float:
        """Rank 0: steps beyond `keep_last` (never `latest` nor the loaded step) go, deleted in the
        background (`commit.Remover`); the seconds this took the save (renames; waiting for a
        previous removal still running)."""
        t0 = time.perf_counter()
        if self.keep_last:
            steps = self.list()
            keep = set(steps[-self.keep_last:]) | {self.latest(), self.loaded_step}
            self._remover.remove(self.root, [self.path(s) for s in steps if s not in keep])
        return time.perf_counter() - t0

    # ---- load
    def load(self, components, optimizer=None, scheduler=None, *, step: int | str = "latest",
             trust_checkpoint: bool = False, restore_rng: bool = True, fallback: bool = False) -> dict:
        """Load checkpoint `step` ("latest" or an int) into `components`; return meta.json's dict.

        `components` as in `save` (a dict of name -> Stateful, or the model chunks with `optimizer`
        and `scheduler`); each is loaded with its `load_state_dict`, in the dict's order.
        Collective. Checked before any tensor is read: trust (`trust_checkpoint=True` skips the
        ownership/mode check, never the safe unpickler), checksums, names and shapes, so a load
        they refuse leaves every tensor as it was. With
        `fallback=True` a damaged checkpoint is skipped for the next older intact one (a warning;
        meta["fallback_from"] lists what was skipped and why). The RNG states are restored when the
        checkpoint has this job's TP/PP layout (meta["rng_restored"]); optimizer state needs the
        saved wrapper and TP/PP/EP (Megatron-FSDP's reshards to another DP size; DDP's needs the world size too).
        meta["restored"] names the components loaded.
        """
        self.wait()
        watch = Stopwatch()   # one run of marks: the phases sum to last_load_s exactly
        self.last_load_phases_s = watch.phases
        with agreed("finding the checkpoint to load under", self.root) as mine:
            mine.value = self._candidates(steps.check_step(step, latest_ok=True), trust_checkpoint, fallback)
        if any(v != mine.values[0] for v in mine.values):
            raise CheckpointError(f"ranks asked for different checkpoints under {self.root}: "
                                  + ", ".join(f"rank {r}: {v[:1]}" for r, v in enumerate(mine.values)))
        skipped = []
        watch.lap("find")
        for s in mine.values[0]:
            try:
                meta = restore.load_dir(self.path(s), components, optimizer, scheduler, trust_checkpoint=trust_checkpoint,
                                        restore_rng=restore_rng, root=self.root, read_threads=self.read_threads,
                                        watch=watch)
            except CheckpointCorruptError as e:
                if not fallback:
                    raise
                skipped.append({"step": s, "error": str(e)})
                watch.lap("find")   # the damaged step's tries count as finding the step to load
                tried = {k: watch.phases.pop(k) for k in list(watch.phases) if k != "find"}
                watch.phases["find"] += sum(v for k, v in tried.items() if "." not in k)
                continue
            break
        else:
            raise CheckpointCorruptError(f"no intact checkpoint under {self.root}; tried steps {mine.values[0]}: "
                                         + "; ".join(f["error"] for f in skipped))
        if skipped:
            msg = (f"loaded checkpoint {self.path(s)} instead of the damaged "
                   f"{', '.join(step_dirname(f['step']) for f in skipped)}: {skipped[0]['error']}")
            warnings.warn(msg)
            log.warning(msg)
        meta["fallback_from"] = skipped
        self.loaded_step = s
        self.last_load_s = watch.lapped()
        return meta

    def _candidates(self, step, trust_checkpoint: bool, fallback: bool) -> list[int]:
        """The step to load, then (with fallback) the older committed ones, newest first."""
        if step == LATEST:
            pointer = self.root / LATEST
            if not os.path.lexists(pointer):
                raise CheckpointError(f"no checkpoint under {self.root} (no {pointer} pointer)")
            if not trust_checkpoint:
                trust.check_path(self.root)
                trust.check_path(pointer)
            step = self.latest()   # O_NOFOLLOW, trusted or not: a linked `latest` is refused unread
            if step is None:
                raise CheckpointError(f"no checkpoint under {self.root} ({pointer} is not a pointer file)")
        older = [s for s in reversed(self.list()) if s < step] if fallback else []
        return [step, *older]


@functools.cache
def io_threads() -> int:
    """Writer / reader threads per rank by default: 8 where every local GPU has 8 or more cores, else 4. Each thread
    crc32s and copies its own file, so save and load scale with cores (4 -> 8 threads measured: docs/benchmarks.md,
    checkpoint, "Every second attributed")."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return 8 if gpus and len(os.sched_getaffinity(0)) // gpus >= 8 else 4


def _kit_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("mfsdp_kit")
    except PackageNotFoundError:
        return "unknown"
