"""Checkpoint faults on 2 gloo ranks (run by launch.run): every rank fails alike and at once.

`faults` saves steps 1 and 2 of the tiny GPT (DDP), then provokes, one after the other: a
non-JSON `extra` on rank 0 only, a full disk (a small tmpfs the test mounted, filled by rank 0),
a commit that fails on rank 0 (`latest` is a directory), a save into a world-writable root with a planted
`latest.tmp` symlink (refused by rank 0's trust check), ranks asking for different steps, a model that does not fit the checkpoint (fewer layers,
narrower), and damaged bytes in the newest checkpoint (with and without `fallback=True`).
For each fault every rank records the error it raised and how long it took; rank 0 returns all.
"""
from __future__ import annotations

import dataclasses
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.checkpoint import CheckpointManager
from mfsdp_kit.config import EngineConfig
from mfsdp_kit.models import gpt_model_fn
from scenarios import SPEC  # noqa: E402  (tests/dist is on the path)
from scenarios_ckpt import _batches, _build, _train  # noqa: E402


def _failure(fn) -> dict:
    """Run fn on every rank; every rank's (error type, message, seconds), gathered."""
    start, error = time.perf_counter(), None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recorded, compared across ranks
        error = e
    mine = dict(type=type(error).__name__ if error else None, message=str(error) if error else None,
                seconds=time.perf_counter() - start)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return dict(per_rank=everyone, same=all(r["message"] == everyone[0]["message"] and r["type"] == everyone[0]["type"]
                                            for r in everyone), **everyone[0])


def _leftovers(root) -> list[str]:
    dist.barrier()
    return sorted(p.name for p in Path(root).iterdir() if p.name.startswith((".tmp-", ".probe-")))


def _fill(tmpfs: Path, leave_bytes: int) -> None:
    """Rank 0: a ballast file that leaves `leave_bytes` free on the tmpfs."""
    if dist.get_rank() == 0:
        (tmpfs / "ballast").unlink(missing_ok=True)
        free = shutil.disk_usage(tmpfs).free
        with open(tmpfs / "ballast", "wb") as f:
            f.write(b"\0" * max(free - leave_bytes, 0))
    dist.barrier()


def _full_disk(mgr: CheckpointManager, tmpfs: Path, chunks, opt, sched) -> dict:
    out = {}
    for name, leave in (("no_space_at_all", 0), ("space_for_a_few_shards", 200_000)):
        _fill(tmpfs, leave)
        out[name] = _failure(lambda: mgr.save(1, chunks, opt, sched))
        out[name]["leftovers"] = _leftovers(tmpfs)
    if dist.get_rank() == 0:
        (tmpfs / "ballast").unlink()
    dist.barrier()
    mgr.save(1, chunks, opt, sched, extra={"data_position": 1})  # space freed: the next save works
    out["after_freeing"] = dict(listed=mgr.list(), latest=mgr.latest(), leftovers=_leftovers(tmpfs))
    return out


def _commit_fails(root: Path, chunks, opt, sched) -> dict:
    """`latest` is a directory: rank 0's commit fails at its last step, after the rename."""
    mgr = CheckpointManager(root)
    if dist.get_rank() == 0:
        (root / "latest").mkdir(parents=True)
    dist.barrier()
    out = _failure(lambda: mgr.save(7, chunks, opt, sched))
    out["left"] = sorted(p.name for p in root.iterdir())
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest").rmdir()
    dist.barrier()
    mgr.save(7, chunks, opt, sched)
    out["after_fixing"] = dict(listed=mgr.list(), latest=mgr.latest())
    return out


def _untrusted_root(root: Path, chunks, opt, sched) -> dict:
    """Rank 0's trust check refuses a world-writable root: every rank raises it, nothing is written through
    the `latest.tmp` symlink planted there (to a file outside the root)."""
    victim = root.parent / "victim"
    if dist.get_rank() == 0:
        root.mkdir(parents=True)
        victim.write_text("root only\n")
        (root / "latest.tmp").symlink_to(victim)
        root.chmod(0o777)
    dist.barrier()
    out = _failure(lambda: CheckpointManager(root).save(1, chunks, opt, sched))
    out["left"], out["victim"] = sorted(p.name for p in root.iterdir()), victim.read_text()
    return out


def _weights(chunks) -> dict:
    return {k: v.detach().clone() for c in chunks for k, v in c.state_dict().items() if torch.is_tensor(v)}


def _does_not_fit(cfg: EngineConfig, mgr: CheckpointManager) -> dict:
    out = {}
    for name, spec in (("one_layer", dataclasses.replace(SPEC, num_layers=1)),
                       ("narrower_mlp", dataclasses.replace(SPEC, ffn_hidden_size=96))):
        runtime.set_seed(3)
        chunks = engine.build(cfg, gpt_model_fn(spec, cfg))
        before = _weights(chunks)
        out[name] = _failure(lambda: mgr.load(chunks, step=1))
        after = _weights(chunks)
        out[name]["untouched"] = all(torch.equal(before[k], after[k]) for k in before)
    return out


def _damage(path: Path) -> None:
    """Rank 0: flip 256 bytes in the middle of rank 1's shard."""
    if dist.get_rank() == 0:
        shard = path / "__1_0.distcp"
        shard.chmod(0o644)
        data = bytearray(shard.read_bytes())
        mid = len(data) // 2
        data[mid:mid + 256] = bytes(b ^ 0xFF for b in data[mid:mid + 256])
        shard.write_bytes(bytes(data))
    dist.barrier()


def faults(*, root: str, tmpfs: str | None) -> dict:
    cfg = EngineConfig(use_megatron_fsdp=False, seed=7)
    runtime.init(cfg)
    rank = dist.get_rank()
    batches = _batches()
    chunks, opt, sched = _build(cfg, 7)
    mgr = CheckpointManager(root)
    result = {}
    _train(chunks, opt, sched, batches, 0, 1)
    mgr.save(1, chunks, opt, sched, extra={"data_position": 1})
    _train(chunks, opt, sched, batches, 1, 2)
    mgr.save(2, chunks, opt, sched, extra={"data_position": 2})
    result["save"] = dict(save_s=mgr.last_save_s, phases_s=mgr.last_save_phases_s, listed=mgr.list())
    bad = {"data_position": torch.tensor(2)} if rank == 0 else {"data_position": 2}
    result["bad_extra"] = _failure(lambda: mgr.save(3, chunks, opt, sched, extra=bad))
    result["bad_extra"]["leftovers"] = _leftovers(root)
    if tmpfs:
        result["full_disk"] = _full_disk(CheckpointManager(tmpfs), Path(tmpfs), chunks, opt, sched)
    result["commit_fails"] = _commit_fails(Path(root).parent / "commit", chunks, opt, sched)
    result["untrusted_root"] = _untrusted_root(Path(root).parent / "untrusted", chunks, opt, sched)
    result["ranks_disagree"] = _failure(lambda: mgr.load(chunks, opt, sched, step=1 if rank == 0 else 99))
    result["does_not_fit"] = _does_not_fit(cfg, mgr)
    _damage(mgr.path(2))
    fresh, fresh_opt, fresh_sched = _build(cfg, 99)
    result["damaged"] = _failure(lambda: mgr.load(fresh, fresh_opt, fresh_sched))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        info = mgr.load(fresh, fresh_opt, fresh_sched, fallback=True)
    resumed = _train(fresh, fresh_opt, fresh_sched, batches, info["extra"]["data_position"], 2)
    straight = _train(*_build(cfg, 7), batches, 0, 2)[1:]
    result["fallback"] = dict(step=info["step"], fallback_from=info["fallback_from"], loaded_step=mgr.loaded_step,
                              warnings=[str(w.message) for w in caught if "instead of the damaged" in str(w.message)],
                              resumed=resumed, straight=straight)
    runtime.shutdown()
    return result
