"""The rollout sync as a plan of views: built once per (rollout model, chunks), replayed every sync.

The naive sync (`sync.export_hf_weights` -> `copy_`) asks Megatron-Bridge to convert every tensor
on every sync: per FSDP unit one blocking all-gather, a `.clone()` of each parameter (so the
bridge never holds bucket memory that is about to be freed), the bridge's per-task Python (PP/TP
bookkeeping, the QKV split as a `cat` of per-group slices) and a `copy_` of its result. For the 1.7 B
tiny `l` model the all-gathers (~1.7 GB per rank) were a small part of that sync's time, the rest the
bridge's per-tensor work (measured: docs/benchmarks.md, sync).

With TP = PP = EP = 1, everything the bridge does to a dense model's weight is a *view* of the full
parameter: a plain copy, a transpose (`permute_dims`), the per-query-group split of the fused QKV
(megatron's [q_1..q_n, k, v] per group), the gate/up halves of a fused SwiGLU fc1, the vocabulary
rows `vocab.trim` keeps, the tied `lm_head` (the embedding again). A `Plan` lists, per megatron
parameter, (HF destination, view of the full value); a sync replays it, per FSDP unit:

    all-gather (the next unit's gather is issued now, so it runs while this one is copied)
    torch._foreach_copy_(dsts, views) straight from the gathered bucket - no clone, one call per group
    release the unit

Host time is what is left on a GPU (the copies and gathers run at memory / link speed), so nothing
that depends only on shapes is redone per sync: the destinations (`dst.view(shape)`) are made once;
the source views once per placement of the parameters (a gathered bucket keeps its storage from one
gather to the next, so that is once); a strided view that is a few contiguous blocks (the QKV split:
one block per query group) is cut into them, so one `_foreach_copy_` over dense pairs (one fused
kernel on CUDA) writes most of a unit and only transposes go through per-tensor copies.

Trust: the views come from the bridge's own mapping objects (`recognised()`: mapping class -> views) and each one is
checked once, when the plan is built, against the bridge's conversion of a random fp32 probe of the parameter's shape.
A check on the real weights would accept a wrong permutation of a norm weight (all ones) and copy wrong values after
the first step; a probe of distinct random values cannot. A task that fails the check, or that the plan does not know
(TP, PP or EP > 1, expert weights, a mapping class outside `recognised()`, FP8, HSDP sharded across instances), stays
on the bridge path: correctness never rests on the plan covering everything.

LoRA (`lora.apply`): the bridge merges an adapted linear as it converts it, W + (alpha / r) B A (its `LoRAMerge`),
for the rollout on every sync. Here an adapted weight is one more entry of its unit: the base W is copied through its
view like any weight, then `addmm_` adds (alpha / r) view(B) A into the destination block by block (the views of a
LoRA target select rows, so B's rows go where W's do; checked on a probe when the plan is built). The adapters are
gathered for the whole replay (`sync.adapters_gathered`; a few MB).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
import weakref
from functools import partial

import torch

from ..config import hsdp
from ..compat.access import bridge_model
from ..compat.access import fsdp as megatron_fsdp
from ..distributed.introspect import is_fsdp
from ..models import vocab
from .views import View, recognised, rows, selects_rows  # noqa: F401 (View: the plan's type)

# ---- the plan --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Adapter:
    """The LoRA adapter of an entry's linear: the merged weight is W + scale * B A."""
    a: torch.Tensor
    """linear_in's weight A [rank, in] (FSDP: full while `sync.adapters_gathered`)."""
    b: torch.Tensor
    """linear_out's weight B [out, rank]."""
    scale: float
    """alpha / rank."""


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    name: str
    param: torch.Tensor
    """The megatron parameter (FSDP: the compute parameter, the full value while its unit is gathered)."""
    dst: torch.Tensor
    """The rollout model's parameter or buffer, written in place."""
    view: View
    adapter: Adapter | None = None
    """Set for a LoRA-adapted linear: `dst` gets view(W) + scale * view(B) A."""


@dataclasses.dataclass(slots=True)
class Unit:
    """Entries whose parameters share one FSDP bucket (one all-gather); fsdp None = DDP / plain."""
    fsdp: object | None
    bucket: int | None
    entries: list[Entry]
    params: list[torch.Tensor] = dataclasses.field(default_factory=list)  # the entries' megatron params, once each
    groups: list[Group] = dataclasses.field(default_factory=list)
    merges: list[tuple[Entry, int, list[torch.Tensor]]] = dataclasses.field(default_factory=list)
    """LoRA-adapted entries: (entry, leading dims cut, its destination blocks as [rows, in] views, made once)."""
    placed: tuple = ()  # where `params` were when the groups' sources were made (`_placement`)


@dataclasses.dataclass(slots=True)
class Group:
    """One `torch._foreach_copy_` of a unit: same dtypes and device, all dense (one fused kernel on
    CUDA) or not (a per-tensor loop in C++). `dsts` are made once; `srcs` when the params move."""
    dsts: list[torch.Tensor]
    pieces: list[tuple[int, View, int]]
    """Per source tensor of the entry, in dsts' order: (index into unit.params, view, leading dims cut)."""
    srcs: list[torch.Tensor] = dataclasses.field(default_factory=list)


MAX_PIECES = 64
"""A strided view is cut into contiguous blocks along leading dims if there are at most this many (QKV:
one per query group); beyond, one strided copy is cheaper to launch."""


@dataclasses.dataclass(slots=True)
class Plan:
    key: tuple
    units: list[Unit]
    fallback: list
    """Conversion tasks the bridge still converts on every sync."""
    planned: int
    """HF tensors the units write."""
    build_s: float
    nbytes: int = 0  # what the units write (rollout dtype)
    names: list[str] = dataclasses.field(default_factory=list)  # the HF names the units write
    adapted: int = 0  # HF tensors written merged with a LoRA adapter
    complete: bool = False
    """The units write every rollout parameter (a sync with the same key needs no check then)."""


def fsdp_owner(chunks, param):
    """The MegatronFSDP whose buffers hold `param` (None for DDP / plain chunks)."""
    return megatron_fsdp.owner(chunks, param)


def _key(hf_model, chunks, bridge) -> tuple:
    """Changes when the rollout model's tensors (object or storage: a `.to()` keeps the Parameter), the
    chunks or their parameters change. Ids are safe: the plan holds every tensor it names, so none of
    those ids (nor a rollout tensor's storage) can be reused meanwhile. Runs on every sync: a walk of
    the modules' own dicts, about half the cost of `named_parameters` + `named_buffers` (docs/benchmarks.md,
    "Figures that used to live in docstrings")."""
    megatron = tuple(megatron_fsdp.param_ids(c.module) if is_fsdp(c)
                     else tuple(id(p) for m in _modules(c) for p in m._parameters.values() if p is not None)
                     for c in chunks)
    hf = tuple((id(t), t.data_ptr()) for m in _modules(hf_model)
               for t in (*m._parameters.values(), *m._buffers.values()) if t is not None)
    return id(bridge), tuple(map(id, chunks)), megatron, hf


def _modules(module) -> list:
    out, stack = [], [module]
    while stack:
        out.append(m := stack.pop())
        stack += [c for c in m._modules.values() if c is not None]
    return out


def _task_views(task) -> dict[str, View] | None:
    """The views the plan would use for this task, or None: the bridge keeps it."""
    mapping, param = task.mapping, task.param_weight
    if param is None or type(param.data) is not torch.Tensor or not param.is_floating_point():
        return None  # another PP rank's, or FP8 / quantized storage
    if mapping.is_expert:
        return None
    if mapping.tp_size != 1 or mapping.pp_size != 1:
        return None
    make = recognised().get(type(mapping))
    return make(mapping, task.megatron_module) if make else None


BASE_LAYER = ".base_layer.weight"
"""The bridge's name for an adapted linear's base W when it does not merge (`merge_adapter_weights=False`)."""


def _checked(task, views, bridge, inner, dsts: dict, hf_vocab: int, vocab_names: set[str]) -> dict[str, View] | None:
    """`views` completed (tied copies, vocabulary trim) if they reproduce the bridge's conversion of a
    random probe exactly, name for name, in the rollout tensors' shapes; else None. An adapted linear's base is
    probed unmerged, and its views must select rows (`views.selects_rows`: B's rows then go where W's do)."""
    param = task.param_weight
    gen = torch.Generator(device=param.device).manual_seed(1234)
    probe = torch.randn(param.shape, dtype=torch.float32, device=param.device, generator=gen)
    want = {name.removesuffix(BASE_LAYER) + (".weight" if name.endswith(BASE_LAYER) else ""):
            vocab.trim(name, t, hf_vocab, vocab_names) for name, t in bridge.export_hf_weights(
                inner, cpu=False, show_progress=False, merge_adapter_weights=False,
                conversion_tasks=[dataclasses.replace(task, param_weight=probe)])}
    if _adapted(task) and not all(selects_rows(v, probe) for v in views.values()):
        return None
    if not set(views) <= set(want):
        return None
    missing = [n for n in want if n not in dsts]
    if missing:
        raise KeyError(f"exported weight {missing[0]!r} has no counterpart in the rollout model")
    out = {}
    for name, expected in want.items():
        if dsts[name].shape != expected.shape or not dsts[name].is_contiguous():
            return None
        candidates = [views[name]] if name in views else list(views.values())  # a tied copy: any view
        for view in candidates:
            got = view(probe)
            if name in vocab_names and got.shape[0] > hf_vocab:
                view = partial(rows, view=view, rows=hf_vocab)
                got = view(probe)
            if got.untyped_storage().data_ptr() != probe.untyped_storage().data_ptr():
                continue  # a copy, not a view: replay reuses views across syncs, a copy would go stale
            if got.numel() == expected.numel() and torch.equal(got.reshape(expected.shape), expected):
                out[name] = view
                break
        else:
            return None
    return out


def _adapted(task) -> bool:
    """An adapted linear's weight (its bias, if any, is the base's: the bridge copies it unmerged)."""
    return task.global_param_name.endswith(".to_wrap.weight")


def _adapter(task, inner) -> Adapter | None:
    """The LoRA adapter of `task`'s linear (a bridge `LoRALinear` holding the task's base W as `to_wrap`), or None
    where the plan cannot merge it: not one model chunk, or not the bridge's plain linear adapter."""
    if len(inner) != 1:
        return None
    wrapper = inner[0].get_submodule(task.global_param_name.partition(".to_wrap.")[0])
    adapter = getattr(wrapper, "adapter", None)
    if type(adapter).__name__ != "ParallelLinearAdapter" or getattr(adapter, "activation", None) is not None and \
            type(adapter.activation).__name__ != "Identity":
        return None
    return Adapter(a=adapter.linear_in.weight, b=adapter.linear_out.weight, scale=adapter.alpha / adapter.dim)


def build(hf_model, chunks, bridge, tasks) -> Plan:
    """Split `tasks` (built in the compute view) into planned units and bridge fallbacks."""
    from ..distributed.engine import unwrap_model
    start = time.perf_counter()
    inner = unwrap_model(list(chunks))
    dsts = {**dict(hf_model.named_parameters()), **dict(hf_model.named_buffers())}
    hf_vocab, vocab_names = bridge.hf_pretrained.config.vocab_size, vocab.hf_vocab_names(bridge)
    units: dict[tuple, Unit] = {}
    fallback, planned = [], 0
    for task in tasks:
        if task is None:
            continue
        views = _task_views(task)
        adapter = _adapter(task, inner) if views is not None and _adapted(task) else None
        if _adapted(task) and adapter is None:
            views = None
        fsdp = fsdp_owner(chunks, task.param_weight)
        if fsdp is not None and (fsdp.data_parallel_sharding_strategy == "no_shard" or hsdp.sharded_across(fsdp)):
            views = None  # no gather here / a gather across HSDP instances too: the bridge path knows those
        if views is not None:
            views = _checked(task, views, bridge, inner, dsts, hf_vocab, vocab_names)
        if views is None:
            fallback.append(task)
            continue
        bucket = megatron_fsdp.unit_of(fsdp, task.param_weight) if fsdp else None
        index = next(i for i, c in enumerate(chunks) if is_fsdp(c) and c.module is fsdp) if fsdp else -1
        unit = units.setdefault((index, bucket), Unit(fsdp, bucket, []))
        unit.entries.extend(Entry(n, task.param_weight, dsts[n], v, adapter) for n, v in views.items())
        planned += len(views)
    ordered = [units[k] for k in sorted(units, key=lambda k: (k[0], -1 if k[1] is None else k[1]))]
    _same_on_every_rank(ordered)
    for unit in ordered:
        _group(unit)
    entries = [e for u in ordered for e in u.entries]
    return Plan(_key(hf_model, chunks, bridge), ordered, fallback, planned, time.perf_counter() - start,
                nbytes=sum(e.dst.numel() * e.dst.element_size() for e in entries), names=[e.name for e in entries],
                adapted=sum(e.adapter is not None for e in entries),
                complete={n for n, _ in hf_model.named_parameters()} <= {e.name for e in entries})


def _cut(view: torch.Tensor) -> int | None:
    """Leading dims to index so that every block is contiguous (0: dense already), None: too many blocks."""
    lead = next(d for d in range(view.dim() + 1) if not view.numel() or view[(0,) * d].is_contiguous())
    return lead if math.prod(view.shape[:lead]) <= MAX_PIECES else None


def _blocks(t: torch.Tensor, lead: int) -> list[torch.Tensor]:
    return [t[index] for index in itertools.product(*map(range, t.shape[:lead]))] if lead else [t]


def _group(unit: Unit) -> None:
    """The unit's copies as `_foreach_copy_` groups, from shapes alone (a meta twin of each parameter,
    laid out as megatron lays it out: contiguous)."""
    index, groups = {}, {}
    for e in unit.entries:
        i = index.setdefault(id(e.param), len(index))
        if i == len(unit.params):
            unit.params.append(e.param)
        src = e.view(torch.empty(e.param.shape, dtype=e.param.dtype, device="meta"))
        lead = _cut(src)  # None: strided, its own group (per-tensor copies)
        group = groups.setdefault((e.dst.dtype, e.param.dtype, e.dst.device, e.param.device, lead is None), Group([], []))
        group.dsts += _blocks(e.dst.view(src.shape), lead or 0)
        group.pieces.append((i, e.view, lead or 0))
        if e.adapter is not None:
            rows_in = [d.view(-1, d.shape[-1]) for d in _blocks(e.dst.view(src.shape), lead or 0)]
            unit.merges.append((e, lead or 0, rows_in))
    unit.groups = list(groups.values())


def _placement(t: torch.Tensor) -> tuple:
    """Storage object, offset, shape, strides. Megatron-FSDP re-points `.data` into the bucket at every
    gather, but a bucket keeps its storage (resized to 0 when released, back when gathered): views made
    once stay valid. Another storage (double buffers) changes this; the views hold theirs, so its id
    cannot be reused while compared."""
    return t.untyped_storage()._cdata, t.storage_offset(), t.shape, t.stride()


def _same_on_every_rank(units: list[Unit]) -> None:
    """Replay all-gathers unit by unit: ranks whose plans differ would pair different collectives
    (a hang, or a gather into the wrong bucket). Built the same way from the same model they
    cannot differ; this one collective per build makes sure. Only with FSDP units (then the sync
    is collective anyway; a DDP sync may run on one rank alone)."""
    import torch.distributed as dist
    if not dist.is_initialized() or not any(u.fsdp is not None for u in units):
        return
    mine = [(u.bucket, [e.name for e in u.entries]) for u in units]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if any(other != mine for other in every):
        raise RuntimeError(f"sync plans differ across ranks (rank {dist.get_rank()}: {len(mine)} units); "
                           "use load_into(..., planned=False)")


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""rollout model -> its Plan (one per model: a new chunks/bridge pair replaces it)."""


def conversion_tasks(chunks, bridge) -> list:
    """The bridge's conversion tasks, in model order (call in the compute view)."""
    from ..distributed.engine import unwrap_model
    return bridge_model.conversion_tasks(bridge, unwrap_model(list(chunks)))


def cached(hf_model, chunks, bridge) -> tuple[Plan, bool]:
    """The plan for this (hf_model, chunks, bridge), built when its key changed (every rank builds
    its own; one collective at the end when it has FSDP units); returns (plan, built_now)."""
    from ..distributed.engine import params_view
    key = _key(hf_model, chunks, bridge)
    plan = _PLANS.get(hf_model)
    if plan is not None and plan.key == key:
        return plan, False
    with params_view(chunks, "compute"):  # the tasks and the buckets both know the compute params
        plan = build(hf_model, chunks, bridge, conversion_tasks(chunks, bridge))
    _PLANS[hf_model] = plan
    return plan, True


# ---- replay ----------------------------------------------------------------------------------------

def _copy(unit: Unit) -> None:
    placed = tuple(map(_placement, unit.params))
    if placed != unit.placed:  # first sync, or the params moved: make the sources again (views, no copies)
        full = [p.detach() for p in unit.params]
        for g in unit.groups:
            g.srcs = [b for i, view, lead in g.pieces for b in _blocks(view(full[i]), lead)]
        unit.placed = placed
    for g in unit.groups:
        torch._foreach_copy_(g.dsts, g.srcs)
    for e, lead, dsts in unit.merges:   # W is in place: add scale * B A, block by block (LoRA)
        a = e.adapter.a.detach().to(e.dst.dtype)
        for dst, b in zip(dsts, _blocks(e.view(e.adapter.b.detach()), lead)):
            dst.addmm_(b.reshape(-1, b.shape[-1]).to(dst.dtype), a, alpha=e.adapter.scale)


def _gathered(fsdp) -> set[int]:
    return megatron_fsdp.gathered_units(fsdp)


@torch.no_grad()
def replay(plan: Plan) -> tuple[int, list[str]]:
    """Copy every planned tensor; returns (bytes written, HF names written). Collective under FSDP.

    Per unit: `all_gather_params(prefetch=True, suggested_AG_prefetch_size=1)` gathers this unit if
    it is not yet and issues the next bucket's gather (one unit ahead: megatron adds bucket groups
    until the prefetch reaches the suggested size); on GPU it runs on Megatron-FSDP's side stream,
    after the copies already queued (megatron makes the gather stream wait for the current one, so
    a released bucket's memory is not reused under a pending copy)."""
    fsdps = {id(u.fsdp): u.fsdp for u in plan.units if u.fsdp is not None}
    before = {k: _gathered(f) for k, f in fsdps.items()}
    try:
        for unit in plan.units:
            if unit.fsdp is not None:
                pipeline = megatron_fsdp.pipeline(unit.fsdp)
                pipeline.all_gather_params(params=[unit.entries[0].param], prefetch=True,
                                           suggested_AG_prefetch_size=1)
                pipeline.wait_bucket_ready(unit.bucket, False)
            _copy(unit)
            if unit.fsdp is not None:
                megatron_fsdp.release_unit(unit.fsdp, unit.bucket)
    finally:  # the last prefetch (and any unit left by an error): release what this sync gathered
        for k, fsdp in fsdps.items():
            for bucket in _gathered(fsdp) - before[k]:
                megatron_fsdp.release_unit(fsdp, bucket)
    return plan.nbytes, plan.names
