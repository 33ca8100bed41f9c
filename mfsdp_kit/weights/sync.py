"""Weights out of the training chunks: stream HF-named full tensors, save an HF folder, or
update a rollout model in place.

Megatron-Bridge 0.3.1 cannot export from Megatron-FSDP chunks (it looks parameters up through
the wrapper and would meet sharded storage). Here the bridge converts the inner modules, and
for FSDP each parameter's bucket (one FSDP unit) is all-gathered by Megatron-FSDP itself just
before its conversion task runs, copied out, and released: extra memory is one unit plus one
tensor, never the whole model. Every rank must iterate the stream (the gathers are collective).

LoRA (`cfg.lora`): the bridge merges each adapted weight as it converts it, W + (alpha / r) B A, so every export
here (the rollout sync, `save_hf`) is of the merged model. Under Megatron-FSDP the adapters are sharded like any
weight: `adapters_gathered` (`lora.adapters`') all-gathers every adapter bucket for the whole export (they are
small; the base units still go one at a time), because the bridge reads them while converting the base weight they
belong to.

`load_into` (the rollout path, run every RL iteration) does not convert tensor by tensor: it
replays a `weights.plan` built once per rollout model (views of the gathered buckets, copied in
place, the next unit's gather in flight meanwhile) and leaves to the bridge only what the plan
does not know.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from .. import lora
from . import plan as sync_plan
from ..distributed import runtime
from ..distributed.engine import params_view, unwrap_model
from ..compat.access import fsdp as megatron_fsdp
from ..distributed.introspect import is_fsdp
from ..lora.adapters import adapters_gathered   # LoRA's (so `sync.adapters_gathered` still names it)
from ..models import vocab
from .plan import fsdp_owner


def _tasks_with_full_params(tasks, chunks) -> Iterator:
    """The conversion tasks with each FSDP param replaced by a private copy of its full value.

    A param's bucket (one FSDP unit) is all-gathered once and held while consecutive tasks use
    it (the bridge visits parameters in model order), then released: one gather per unit, not
    per parameter, and at most one unit unsharded at a time.
    """
    held = None  # (fsdp, bucket id) all-gathered now
    try:
        for task in tasks:
            if task is None:
                continue
            fsdp = fsdp_owner(chunks, task.param_weight)
            if fsdp is None:
                yield task
                continue
            bucket = megatron_fsdp.unit_of(fsdp, task.param_weight)
            if held != (fsdp, bucket):
                if held is not None:
                    megatron_fsdp.release_unit(*held)
                fsdp.all_gather_and_wait_parameters_ready(params=[task.param_weight], prefetch=False)
                held = (fsdp, bucket)
            yield dataclasses.replace(task, param_weight=task.param_weight.detach().clone())
    finally:
        if held is not None:
            megatron_fsdp.release_unit(*held)


def export_hf_weights(chunks, bridge, *, cpu: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for every HF weight, from DDP or Megatron-FSDP chunks, any TP."""
    with params_view(chunks, "compute"):  # name lookup and bucket lookup both use the compute params
        yield from _export(chunks, bridge, sync_plan.conversion_tasks(chunks, bridge), cpu=cpu)


def _export(chunks, bridge, tasks, *, cpu: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The bridge's conversion of `tasks` (call in the compute view), FSDP units gathered one at a time."""
    inner = unwrap_model(list(chunks))
    if any(is_fsdp(c) for c in chunks):
        tasks = _tasks_with_full_params(tasks, chunks)
    hf_vocab, vocab_names = bridge.hf_pretrained.config.vocab_size, vocab.hf_vocab_names(bridge)
    live = {p.untyped_storage().data_ptr() for c in inner for p in c.parameters()}
    with adapters_gathered(chunks):
        for name, tensor in bridge.export_hf_weights(inner, cpu=cpu, show_progress=False, conversion_tasks=tasks):
            tensor = vocab.trim(name, tensor, hf_vocab, vocab_names)  # padded vocabulary rows never leave
            # The bridge can hand back the live parameter itself (TP=1, already on the target
            # device): copy it, or a later optimizer step would change what was exported.
            yield name, tensor.clone() if tensor.untyped_storage().data_ptr() in live else tensor


@torch.no_grad()
def load_into(hf_model: torch.nn.Module, chunks, bridge, *, planned: bool = True) -> dict:
    """Copy the chunks' weights into `hf_model` in place (the rollout path). Collective under FSDP.

    planned=True (default): the tensors `weights.plan` knows are copied by its cached plan (views of
    the gathered buckets, next unit prefetched), the rest through the bridge as before;
    planned=False: every tensor through the bridge (`export_hf_weights`).
    Returns seconds, bytes, tensors, and per path: planned / bridge tensor counts, plan_built
    (this call built the plan) and plan_s (its build time, inside seconds).
    """
    start = time.perf_counter()
    plan, built, nbytes, seen = None, False, 0, []
    if planned:
        plan, built = sync_plan.cached(hf_model, chunks, bridge)
        with adapters_gathered(chunks) if plan.adapted else contextlib.nullcontext():
            nbytes, seen = sync_plan.replay(plan)
        if not plan.fallback and plan.complete:  # same tensors as when the plan was built and checked
            return dict(seconds=time.perf_counter() - start, bytes=nbytes, tensors=len(set(seen)), planned=plan.planned,
                        bridge=0, plan_built=built, plan_s=plan.build_s if built else 0.0)
        seen = list(seen)
    if plan is None or plan.fallback:
        targets = {**dict(hf_model.named_parameters()), **dict(hf_model.named_buffers())}
        with params_view(chunks, "compute"):
            tasks = plan.fallback if plan else sync_plan.conversion_tasks(chunks, bridge)
            for name, tensor in _export(chunks, bridge, tasks, cpu=False):
                if name not in targets:
                    raise KeyError(f"exported weight {name!r} has no counterpart in {type(hf_model).__name__}")
                target = targets[name]
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
                nbytes += target.numel() * target.element_size()
                seen.append(name)
    seen = set(seen)
    missing = [n for n, _ in hf_model.named_parameters() if n not in seen]
    if missing:
        raise KeyError(f"{len(missing)} weights of {type(hf_model).__name__} were not exported, e.g. {missing[:3]}")
    n_planned = plan.planned if plan else 0
    return dict(seconds=time.perf_counter() - start, bytes=nbytes, tensors=len(seen), planned=n_planned,
                bridge=len(seen) - n_planned, plan_built=built, plan_s=plan.build_s if built else 0.0)


def save_hf(chunks, bridge, path, *, shard_bytes: int = 2 * 2**30, merged: bool = True) -> Path:
    """Write an HF folder (config, tokenizer, safetensors shards + index) that `transformers` loads.

    Collective: every rank streams the weights; rank 0 writes. `shard_bytes` bounds each file.
    A LoRA model's weights are written merged (W + (alpha / r) B A: a plain model, no peft needed to load it);
    for the adapters alone use `adapters.save_adapter` (its base is the folder the model was loaded from).
    """
    from safetensors.torch import save_file
    if not merged and lora.has_adapters(chunks):
        from ..fieldtypes import bad_value
        raise bad_value("merged", merged, "True: a LoRA model is saved merged; adapters.save_adapter writes the "
                        "adapters alone, and their base is the unchanged folder the model was loaded from")
    path = Path(path)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        path.mkdir(parents=True, exist_ok=True)
        bridge.hf_pretrained.save_artifacts(path)
    shard, shard_size, weight_map, files = {}, 0, {}, []

    def flush():
        nonlocal shard, shard_size
        if shard and rank0:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file({k: v.contiguous() for k, v in shard.items()}, str(path / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in shard})
        shard, shard_size = {}, 0

    for name, tensor in export_hf_weights(chunks, bridge, cpu=True):
        if rank0:
            shard[name] = tensor
            shard_size += tensor.numel() * tensor.element_size()
        if shard_size >= shard_bytes:
            flush()
    flush()
    if rank0:
        _write_index(path, files, weight_map)
    runtime.barrier()
    return path


def _write_index(path: Path, files: list[str], weight_map: dict) -> None:
    """One file -> model.safetensors; several -> the usual sharded index."""
    if len(files) == 1:
        (path / files[0]).rename(path / "model.safetensors")
        return
    total = sum((path / f).stat().st_size for f in files)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
