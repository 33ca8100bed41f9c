"""A checkpoint's parts: a dict of name -> torch.distributed.checkpoint `Stateful`, split by format.

    components = {"model": ModelState(chunks), "optimizer": OptimizerState(chunks, opt),
                  "rng": RNGState(), "scheduler": scheduler, "data": my_loader}
    ckpt.save(step, components);  ckpt.load(components)

The naive way hands the dict to `dcp.save` / `dcp.load`, which call `state_dict()` /
`load_state_dict()` themselves. The kit calls them (`collect`, then each component's
`load_state_dict` after the read), because between the two it must: mark Megatron-FSDP's uneven
shards, stage an async copy, check names and shapes before any tensor is read, and keep values
that are not tensors out of pickles. Where a component goes:
- "dcp": into torch DCP under `<name>.` (the kit's ModelState, OptimizerState, RNGState, and any
  component whose state holds a tensor: a data loader's position tensor, say);
- "json": a component whose state holds no tensor (megatron's scheduler, a counter) goes to
  `<name>.json` (so `scheduler.json`, as before) - written by rank 0, pickle-free.
A component may fix its format with the attribute `checkpoint_format`. Names are identifiers
(they become DCP key prefixes and file names); every rank must pass the same names.
"""
from __future__ import annotations

import json

import torch
from torch.distributed.checkpoint.stateful import Stateful

from .errors import CheckpointError
from .state import ModelState, OptimizerState, RNGState

RESERVED = {"meta"}
"""Names a component may not take (`meta.json` is the checkpoint's own record)."""


def as_components(components, optimizer=None, scheduler=None, *, rng: bool = True) -> dict:
    """`components` when it is a dict; else the kit's standard dict built from model chunks.

    `(chunks, optimizer, scheduler)` -> {"model", "optimizer" (if given), "rng" (if `rng`),
    "scheduler" (if given)}: the call form `save(step, chunks, opt, sched)` is this dict.
    """
    if isinstance(components, dict):
        if optimizer is not None or scheduler is not None:
            raise TypeError("pass the optimizer and scheduler inside the components dict "
                            "(e.g. {'optimizer': OptimizerState(chunks, opt), 'scheduler': sched}), not as arguments")
        return dict(components)
    chunks = list(components)
    out: dict = {"model": ModelState(chunks)}
    if optimizer is not None:
        out["optimizer"] = OptimizerState(chunks, optimizer)
    if rng:
        out["rng"] = RNGState()
    if scheduler is not None:
        out["scheduler"] = scheduler
    return out


def load(comp, state_dict) -> None:
    """`comp.load_state_dict(state_dict)`. megatron's scheduler counts the saved steps on top of its own
    (`OptimizerParamScheduler.load_state_dict` calls `step(increment=saved)`), so one that has stepped is set back
    to 0 first: loaded into a live job (a fallback after training on, a notebook's earlier step) it holds the
    saved count, as a fresh one does."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    if isinstance(comp, OptimizerParamScheduler):
        comp.num_steps = 0
    comp.load_state_dict(state_dict)


def check(components: dict) -> None:
    """Raise CheckpointError for a name that cannot be a key prefix / file name, or a non-Stateful."""
    for name, comp in components.items():
        if not isinstance(name, str) or not name.isidentifier() or name in RESERVED:
            raise CheckpointError(f"component name {name!r} is not allowed; allowed: a Python identifier other "
                                  f"than {sorted(RESERVED)} (it becomes a DCP key prefix and a file name)")
        if not isinstance(comp, Stateful):
            raise CheckpointError(f"component {name!r} ({type(comp).__name__}) is not a torch.distributed.checkpoint "
                                  "Stateful: it needs state_dict() and load_state_dict(state_dict)")


def model(components: dict) -> ModelState | None:
    """The component meta.json describes (fsdp, num_chunks): "model" if a ModelState, else the first one."""
    if isinstance(components.get("model"), ModelState):
        return components["model"]
    return next((c for c in components.values() if isinstance(c, ModelState)), None)


def has_tensor(value) -> bool:
    if isinstance(value, dict):
        return any(has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(has_tensor(v) for v in value)
    return torch.is_tensor(value)


def collect(components: dict, *, loading: bool) -> tuple[dict, dict]:
    """(for DCP: {name: state dict}, for JSON: {name: state dict}), called in the dict's order.

    Saving calls `state_dict()`; loading `state_dict_for_load()` where a component has it. The
    JSON parts are copied through `json` (a snapshot that training cannot change; a value JSON
    cannot hold raises CheckpointError naming the component).
    """
    dcp_part, json_part = {}, {}
    for name, comp in components.items():
        get = getattr(comp, "state_dict_for_load", None) if loading else None
        sd = get() if get is not None else comp.state_dict()
        fmt = getattr(comp, "checkpoint_format", None) or ("dcp" if has_tensor(sd) else "json")
        if fmt == "dcp":
            dcp_part[name] = sd
            continue
        try:
            json_part[name] = json.loads(json.dumps(sd))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"component {name!r} holds no tensor, so it goes to {name}.json, but JSON cannot "
                                  f"hold its state ({e}): return tensors, or numbers, strings, lists and dicts") from e
    return dcp_part, json_part


def formats(dcp_part: dict, json_part: dict) -> dict:
    """{name: "dcp" | "json"} as meta.json's `components` records it."""
    return {**{n: "dcp" for n in dcp_part}, **{n: "json" for n in json_part}}


def accepted(components: dict, meta: dict, path, *, restore_rng: bool = True) -> dict:
    """The components to load from this checkpoint: each one's `accepts(meta, path)` may raise
    (it cannot load) or return False (skipped, with its own warning); `restore_rng=False` drops RNGState."""
    saved = meta.get("components")
    out = {}
    for name, comp in components.items():
        if isinstance(comp, RNGState) and not restore_rng:
            continue
        if saved is not None and name not in saved:
            raise CheckpointError(f"{path} holds no component {name!r} (it holds {', '.join(saved)}); "
                                  f"leave {name!r} out of the components to load")
        if getattr(comp, "accepts", None) is None or comp.accepts(meta, path):
            out[name] = comp
    return out


def strict_prefixes(components: dict) -> tuple:
    """DCP key prefixes under which every checkpoint key must be asked for (the model's own names)."""
    return tuple(f"{name}.{comp.strict_prefix()}" for name, comp in components.items()
                 if getattr(comp, "strict_prefix", None) is not None)
