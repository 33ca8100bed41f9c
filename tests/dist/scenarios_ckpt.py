"""Checkpoint scenarios (run by launch.run under torchrun). Each returns rank 0's findings.

Deterministic settings behind the exact-resume checks: fp32, dropout 0, fixed batches indexed
by step (the data position is saved in `extra`), gloo on CPU (deterministic reductions), one
thread per rank (launch.py sets OMP_NUM_THREADS=1), and the same 2-rank layout before and after.
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from mfsdp_kit import checkpoint as ckpt
from mfsdp_kit.checkpoint import state as ckpt_state
from mfsdp_kit.checkpoint import storage as ckpt_storage
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.models import gpt_model_fn
from mfsdp_kit.train import step
from scenarios import SPEC, random_batches  # noqa: E402  (tests/dist is on the path)

STEPS, SAVE_AT, GLOBAL_BATCH, MICRO = 10, 5, 4, 2
OCFG = OptimConfig(lr=3e-3, warmup_steps=2, decay_steps=20, min_lr=1e-4)


@torch.no_grad()
def _megatron_logits(chunks, tokens):
    from mfsdp_kit.train.generate import logits
    return logits(chunks, tokens.to(runtime.current().device), vocab_size=128).cpu()


def _batches():
    batch = GLOBAL_BATCH * dist.get_world_size() // 2   # GLOBAL_BATCH on 2 ranks, as many per rank on 4
    return random_batches(steps=STEPS, batch=batch, seq=SPEC.seq_len_tokens, vocab=SPEC.vocab_size, seed=4)


def _build(cfg: EngineConfig, seed: int, ocfg: OptimConfig = OCFG):
    runtime.set_seed(seed)
    chunks = engine.build(cfg, gpt_model_fn(SPEC, cfg))
    opt = engine.build_optimizer(chunks, ocfg, cfg)
    return chunks, opt, engine.build_scheduler(opt, ocfg)


def _train(chunks, opt, sched, batches, start: int, stop: int) -> list[float]:
    return [step(chunks, opt, batches[i], micro_batch_size=MICRO, scheduler=sched, step_index=i).loss
            for i in range(start, stop)]


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif torch.is_tensor(v):
            out[prefix + str(k)] = (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
    return out


def _saved_state(chunks, opt) -> tuple[dict, ckpt.OptimizerState]:
    """What a save hands DCP: each standard component's state_dict (model, optimizer, RNG)."""
    parts = ckpt.as_components(chunks, opt)
    return {name: part.state_dict() for name, part in parts.items()}, parts["optimizer"]


def local_snapshot(chunks, opt, fsdp: bool) -> dict:
    """Every model, optimizer and RNG tensor this rank holds (local shards), copied."""
    state, opt_state = _saved_state(chunks, opt)
    for key in opt_state.padded:
        del state["optimizer"]["state"][key]
    return _flat(state)


def _compare(a: dict, b: dict) -> dict:
    keys = sorted(set(a) | set(b))
    differ = [k for k in keys if k not in a or k not in b or a[k].device != b[k].device or not torch.equal(a[k], b[k])]
    groups = {g: sum(k.startswith(g) for k in keys) for g in ("model", "optimizer", "rng")}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dict(differ=differ[:5], n_differ=len(differ), groups=groups))
    return dict(per_rank=everyone, all_equal=all(r["n_differ"] == 0 for r in everyone))


def full_weights(chunks) -> dict:
    """Canonical name -> full tensor, assembled from each rank's (uneven) shard by offsets."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata
    out = {}
    for name, v in ckpt.ModelState(chunks).state_dict()["0"].items():
        if not hasattr(v, "to_local"):
            out[name] = v.detach().clone()
            continue
        meta = gather_and_compute_chunk_metadata(v)
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (meta.offsets, v.to_local().detach().clone()))
        full = torch.empty(v.shape, dtype=v.dtype)
        for offsets, local in parts:
            if local.numel():
                full[tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))] = local
        out[name] = full
    return out


def weights_as_saved(chunks, root: str) -> dict:
    """equal: these chunks' full weights are bit for bit those `train_save` wrote beside step SAVE_AT; n: how many."""
    ref = torch.load(Path(root) / f"full_step{SAVE_AT}.pt", map_location="cpu")
    got = {k: v.cpu() for k, v in full_weights(chunks).items()}
    return dict(equal=sorted(ref) == sorted(got) and all(torch.equal(ref[k], got[k]) for k in ref), n=len(ref))


def _uneven_metadata_matches_megatron(chunks, opt) -> dict:
    """checkpoint.state.mark_uneven_shards (one collective) vs megatron's per-tensor preprocessing."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor)
    ours = _saved_state(chunks, opt)[0]
    ckpt_state.mark_uneven_shards(ours)
    ours = {k: t._local_tensor.__create_chunk_list__() for k, t in ckpt_state.dtensors(ours)}
    theirs = _saved_state(chunks, opt)[0]
    for _, t in ckpt_state.dtensors(theirs):  # in case the local tensors are shared with `ours`
        for attr in ("__create_chunk_list__", "__create_write_items__"):
            if hasattr(t._local_tensor, attr):
                delattr(t._local_tensor, attr)
    preprocess_state_dict_for_uneven_dtensor(theirs)
    theirs = {k: t._local_tensor.__create_chunk_list__() for k, t in ckpt_state.dtensors(theirs)}
    counts = torch.tensor([sum(any(c.offsets) for v in ours.values() for c in v), int(ours != theirs)],
                          device=runtime.current().device)  # NCCL reduces device tensors only
    dist.all_reduce(counts)  # over ranks: rank 0's offsets are all 0
    return dict(n=len(ours), equal=counts[1].item() == 0, nonzero_offsets=counts[0].item())


def train_save(*, fsdp: bool, root: str, hf_workdir: str | None = None, ddp: dict | None = None) -> dict:
    """10 steps straight, saving at step 5 (and 10); at step 5 also a bitwise round trip into a
    fresh build (another seed); optionally an HF-sourced FSDP checkpoint for to_hf. `ddp`: override_ddp_config."""
    cfg = EngineConfig(use_megatron_fsdp=fsdp, seed=7, override_ddp_config=ddp or {})
    rt = runtime.init(cfg)
    batches = _batches()
    chunks, opt, sched = _build(cfg, 7)
    mgr = ckpt.CheckpointManager(root, keep_last=1)
    losses = _train(chunks, opt, sched, batches, 0, SAVE_AT)
    before = local_snapshot(chunks, opt, fsdp)
    same_chunks = _uneven_metadata_matches_megatron(chunks, opt) if fsdp else None
    mgr.save(SAVE_AT, chunks, opt, sched, extra={"data_position": SAVE_AT})
    save_s = mgr.last_save_s
    if rt.rank == 0:
        torch.save(full_weights(chunks), Path(root) / f"full_step{SAVE_AT}.pt")
    else:
        full_weights(chunks)
    # Round trip: a fresh build (different seed) loads step 5 and must hold identical tensors.
    fresh, fresh_opt, fresh_sched = _build(cfg, 99)
    differs_before_load = _compare(before, local_snapshot(fresh, fresh_opt, fsdp))["all_equal"] is False
    info = mgr.load(fresh, fresh_opt, fresh_sched)
    roundtrip = _compare(before, local_snapshot(fresh, fresh_opt, fsdp))
    sched_equal = fresh_sched.state_dict() == sched.state_dict()
    del fresh, fresh_opt
    engine.restore_fsdp_params(chunks)
    losses += _train(chunks, opt, sched, batches, SAVE_AT, STEPS)
    mgr.save(STEPS, chunks, opt, sched, extra={"data_position": STEPS})  # keep_last=1 keeps 5: it was loaded
    result = dict(losses=losses, roundtrip=roundtrip, differs_before_load=differs_before_load,
                  sched_equal=sched_equal, extra=info["extra"], same_chunks=same_chunks, rng_restored=info["rng_restored"],
                  save_s=save_s, load_s=mgr.last_load_s, bytes=info["bytes"], listed=mgr.list(),
                  latest=mgr.latest())
    if hf_workdir:
        result["hf"] = _hf_checkpoint(cfg, hf_workdir)
    runtime.shutdown()
    return result


def _hf_checkpoint(cfg: EngineConfig, workdir: str) -> dict:
    from mfsdp_kit.models.hf import load
    from mfsdp_kit.models.tiny import tiny
    src = f"{workdir}/tiny_src"
    if dist.get_rank() == 0:
        tiny(src, size="xs", seed=1)
    dist.barrier()
    model = load(src, cfg)
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-2), cfg)
    b = random_batches(steps=1, batch=4, seq=16, vocab=128, seed=9)[0]
    step(model.chunks, opt, b, micro_batch_size=2)
    root = f"{workdir}/hf_ckpt"
    path = ckpt.CheckpointManager(root, hf_source=src).save(1, model.chunks, opt)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    logits = _megatron_logits(model.chunks, tokens)
    if dist.get_rank() == 0:
        torch.save(dict(tokens=tokens, logits=logits), f"{workdir}/live_logits.pt")
    return dict(path=str(path), src=src)


def resume(*, fsdp: bool, root: str, ddp: dict | None = None) -> dict:
    """A fresh process: build with another seed, load step 5 (saved by `save(step, chunks, opt, sched)`)
    as a dict of Stateful components, train steps 5..9."""
    cfg = EngineConfig(use_megatron_fsdp=fsdp, seed=7, override_ddp_config=ddp or {})
    runtime.init(cfg)
    batches = _batches()
    chunks, opt, sched = _build(cfg, 1234)
    parts = {"model": ckpt.ModelState(chunks), "optimizer": ckpt.OptimizerState(chunks, opt), "rng": ckpt.RNGState(),
             "scheduler": sched}
    info = ckpt.CheckpointManager(root).load(parts, step=SAVE_AT)
    start = info["extra"]["data_position"]
    losses = _train(chunks, opt, sched, batches, start, STEPS)
    runtime.shutdown()
    return dict(losses=losses, start=start, rng_restored=info["rng_restored"])


def crash_during_save(*, root: str) -> dict:
    """Save step 1, then rank 1 SIGKILLs itself in the middle of saving step 2 (after its DCP files)."""
    cfg = EngineConfig(use_megatron_fsdp=False, seed=7)
    runtime.init(cfg)
    chunks, opt, sched = _build(cfg, 7)
    batches = _batches()
    _train(chunks, opt, sched, batches, 0, 1)
    mgr = ckpt.CheckpointManager(root)
    mgr.save(1, chunks, opt, sched)
    _train(chunks, opt, sched, batches, 1, 2)
    original = ckpt_storage.write

    def write_then_die(state, path, **kw):
        out = original(state, path, **kw)
        if dist.get_rank() == 1:
            os.kill(os.getpid(), 9)
        dist.barrier()  # rank 0 waits here, like any rank still in the save's collectives
        return out
    ckpt_storage.write = write_then_die
    mgr.save(2, chunks, opt, sched)
    return dict(unreachable=True)


def single_rank_checks(*, roots: dict, crash_root: str, hf_workdir: str) -> dict:
    """World size 1: reshard 2-rank FSDP/DDP checkpoints into 1-rank FSDP and DDP; the crashed
    root still loads; to_hf matches the live model's logits."""
    result = {}
    for wrapper in ("fsdp", "ddp"):
        cfg = EngineConfig(use_megatron_fsdp=wrapper == "fsdp", seed=7)
        runtime.init(cfg)
        for saved, root in roots.items():
            chunks, _, _ = _build(cfg, 99)
            info = ckpt.CheckpointManager(root).load(chunks, step=SAVE_AT)
            result[f"{saved}->{wrapper}"] = dict(**weights_as_saved(chunks, root), rng_restored=info["rng_restored"])
        runtime.shutdown()
    cfg = EngineConfig(use_megatron_fsdp=False, seed=7)
    runtime.init(cfg)
    mgr = ckpt.CheckpointManager(crash_root)
    chunks, _, _ = _build(cfg, 99)
    info = mgr.load(chunks)
    result["crash"] = dict(latest=mgr.latest(), listed=mgr.list(), loaded_step=info["step"],
                           leftovers=sorted(p.name for p in Path(crash_root).iterdir()))
    runtime.shutdown(destroy_process_group=True)
    # to_hf in this (now world-less) process
    import transformers
    out = ckpt.to_hf(f"{hf_workdir}/hf_ckpt/step_000001", f"{hf_workdir}/hf_out")
    live = torch.load(f"{hf_workdir}/live_logits.pt")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        result["to_hf_logits_maxdiff"] = (hf(live["tokens"]).logits - live["logits"]).abs().max().item()
    return result


def async_save(*, fsdp: bool, root: str) -> dict:
    """async_save: save step 3 in the background while training steps 3..4 change every tensor;
    the files hold step 3's tensors (bitwise, into a fresh build); a second async save waits for
    the first; resuming from step 3 reproduces the straight run's losses."""
    cfg = EngineConfig(use_megatron_fsdp=fsdp, seed=7)
    runtime.init(cfg)
    batches = _batches()
    chunks, opt, sched = _build(cfg, 7)
    mgr = ckpt.CheckpointManager(root, async_save=True)
    losses = _train(chunks, opt, sched, batches, 0, 3)
    before = local_snapshot(chunks, opt, fsdp)
    mgr.save(3, chunks, opt, sched, extra={"data_position": 3})
    pending_after_save = mgr._pending is not None and mgr.latest() is None  # not committed yet
    losses += _train(chunks, opt, sched, batches, 3, 5)  # overlaps the background write
    changed = _compare(before, local_snapshot(chunks, opt, fsdp))["all_equal"] is False
    mgr.save(5, chunks, opt, sched, extra={"data_position": 5})  # waits for (commits) step 3 first
    listed_after_second = mgr.list()
    mgr.wait()
    fresh, fresh_opt, fresh_sched = _build(cfg, 99)
    info = mgr.load(fresh, fresh_opt, fresh_sched, step=3)
    roundtrip = _compare(before, local_snapshot(fresh, fresh_opt, fsdp))
    resumed = _train(fresh, fresh_opt, fresh_sched, batches, info["extra"]["data_position"], 5)
    runtime.shutdown()
    return dict(pending_after_save=pending_after_save, changed=changed, listed_after_second=listed_after_second,
                listed=mgr.list(), latest=mgr.latest(), roundtrip=roundtrip, straight=losses[3:5], resumed=resumed)


def io_options(*, fsdp: bool, root: str) -> dict:
    """The I/O options: 3 writer threads, staged host copies, 3 then 1 reader threads. Save step 3,
    train on (every tensor changes), load step 3 into the SAME optimizer (its Adam state exists:
    megatron's zero-gradient step is skipped) and into a fresh build; both bitwise. meta.json's
    checksums (hashed by the writer threads) equal a crc32 of the files read back."""
    cfg = EngineConfig(use_megatron_fsdp=fsdp, seed=7)
    rt = runtime.init(cfg)
    batches = _batches()
    chunks, opt, sched = _build(cfg, 7)
    mgr = ckpt.CheckpointManager(root, write_threads=3, read_threads=3, host_staging=True)
    _train(chunks, opt, sched, batches, 0, 3)
    before = local_snapshot(chunks, opt, fsdp)
    mgr.save(3, chunks, opt, sched)
    _train(chunks, opt, sched, batches, 3, 5)
    changed = _compare(before, local_snapshot(chunks, opt, fsdp))["all_equal"] is False
    mgr.load(chunks, opt, sched, step=3)
    same_opt = _compare(before, local_snapshot(chunks, opt, fsdp))
    fresh, fresh_opt, fresh_sched = _build(cfg, 99)
    ckpt.CheckpointManager(root, read_threads=1).load(fresh, fresh_opt, fresh_sched, step=3)
    one_reader = _compare(before, local_snapshot(fresh, fresh_opt, fsdp))
    meta = json.loads((mgr.path(3) / "meta.json").read_text())
    reread = {n: f"{zlib.crc32((mgr.path(3) / n).read_bytes()):08x}" for n in meta["files"]} if rt.rank == 0 else None
    runtime.shutdown()
    return dict(changed=changed, same_opt=same_opt, one_reader=one_reader, phases=mgr.last_save_phases_s,
                save_s=mgr.last_save_s,
                load_phases=mgr.last_load_phases_s, files=meta["files"],
                recorded={n: c["crc32"] for n, c in meta["checksums"].items()}, reread=reread)


class Loader:
    """A user's data loader: a shuffled order and a position, both tensors (DCP: `data.order`,
    `data.position`). The same on every rank (it indexes global batches)."""

    def __init__(self, n: int, seed: int):
        self.order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        self.position = torch.zeros((), dtype=torch.int64)

    def next(self) -> int:
        i = int(self.order[self.position])
        self.position += 1
        return i

    def state_dict(self) -> dict:
        return {"order": self.order, "position": self.position}

    def load_state_dict(self, state_dict: dict) -> None:
        self.order.copy_(state_dict["order"])
        self.position.copy_(state_dict["position"])


class Counter:
    """A user's counter without tensors: it goes to `counter.json`."""

    def __init__(self):
        self.tokens_seen = 0

    def state_dict(self) -> dict:
        return {"tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: dict) -> None:
        self.tokens_seen = state_dict["tokens_seen"]


def _train_from(parts: dict, batches, n: int) -> list[float]:
    chunks, opt = parts["model"].chunks, parts["optimizer"].optimizer
    losses = []
    for _ in range(n):
        i = parts["data"].next()
        parts["counter"].tokens_seen += GLOBAL_BATCH * SPEC.seq_len_tokens
        losses.append(step(chunks, opt, batches[i], micro_batch_size=MICRO, scheduler=parts["scheduler"],
                           step_index=i).loss)
    return losses


def _parts(cfg: EngineConfig, seed: int, loader_seed: int) -> dict:
    chunks, opt, sched = _build(cfg, seed)
    return {"model": ckpt.ModelState(chunks), "optimizer": ckpt.OptimizerState(chunks, opt), "rng": ckpt.RNGState(),
            "scheduler": sched, "data": Loader(STEPS, loader_seed), "counter": Counter()}


def custom_stateful(*, root: str) -> dict:
    """Per wrapper: save step 3 as a dict of Stateful components with two of the user's own (a data
    loader of tensors, a counter without), train on; a fresh build with another loader order
    loads it and must continue with the same losses, loader position, order and counter."""
    from mfsdp_kit.checkpoint.restore import checked
    result = {}
    for wrapper in ("ddp", "fsdp"):
        cfg = EngineConfig(use_megatron_fsdp=wrapper == "fsdp", seed=7)
        runtime.init(cfg)
        batches = _batches()
        parts = _parts(cfg, 7, loader_seed=3)
        mgr = ckpt.CheckpointManager(f"{root}/{wrapper}")
        _train_from(parts, batches, 3)
        path = mgr.save(3, parts)
        saved_counter = parts["counter"].tokens_seen
        straight = _train_from(parts, batches, 3)
        fresh = _parts(cfg, 99, loader_seed=11)
        differs = not torch.equal(fresh["data"].order, parts["data"].order)
        info = mgr.load(fresh)
        loaded = dict(position=int(fresh["data"].position), counter=fresh["counter"].tokens_seen,
                      order_equal=torch.equal(fresh["data"].order, Loader(STEPS, 3).order))
        resumed = _train_from(fresh, batches, 3)
        meta, metadata = checked(path, trust_checkpoint=False)
        chunks, _, _ = _build(cfg, 5)
        legacy = mgr.load(chunks, step=3)["restored"]  # the call form with chunks: model and RNG only
        missing = None
        try:
            mgr.load({"model": ckpt.ModelState(chunks), "other": Counter()}, step=3)
        except ckpt.CheckpointError as e:
            missing = str(e)
        result[wrapper] = dict(straight=straight, resumed=resumed, differs_before_load=differs, loaded=loaded,
                               saved_counter=saved_counter,
                               restored=info["restored"], rng_restored=info["rng_restored"],
                               components=meta["components"], files=sorted(meta["files"]),
                               data_keys=sorted(k for k in metadata.state_dict_metadata if k.startswith("data.")),
                               legacy=legacy, missing=missing)
        runtime.shutdown()
    return result
