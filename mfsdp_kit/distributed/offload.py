"""Offload this rank's model state to (pinned) CPU memory and bring it back, in place.

Why the kit does this itself: megatron-core 0.16.1's `optimizer_cpu_offload` fails with
Megatron-FSDP ("Operator aten.is_pinned.default does not have a sharding strategy
registered": its hybrid optimizer meets DTensor shards; verl #7698, Megatron-LM #1986).

The naive version would move tensors with `.to("cpu")` and hand back new objects; megatron
would keep using the old ones (parameters, `main_grad`s, DTensor shards and optimizer state
are all VIEWS into a few flat buffers). So this module works on STORAGES instead:
    offload: copy each distinct storage's bytes to a host tensor, then `storage.resize_(0)`
             (device memory is really freed; every view keeps its storage object)
    reload:  `storage.resize_(nbytes)`, copy the bytes back -> every view is valid again.
Byte copies, so a round trip is bitwise exact. What moves, per rank (fp32 Adam, ZeRO-3 over N):
    model weights 4 B + main weights 4 B + main grads 4 B + exp_avg 4 B + exp_avg_sq 4 B
    = 20 B x params / N  (Megatron-FSDP keeps a separate fp32 main copy even for fp32 compute).
While offloaded, a forward, `zero_grad_buffer`, `optimizer.step` and `optimizer.zero_grad`
raise `OffloadedError` naming the fix. `stream_optimizer` is the per-step variant: optimizer
state and main weights live on the host and visit the device only for `optimizer.step()`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import step_pipeline
from ..compat.access import fsdp
from . import clock
from .introspect import (fsdp_buffers, inner_optimizers, is_fsdp, local, main_params, param_view,
                         set_param_view)

KINDS = ("model_weights", "main_weights", "main_grads", "optimizer_states")
OPTIMIZER_KINDS = ("main_weights", "optimizer_states")
_ATTR = "_mfsdp_offload_state"


class OffloadedError(RuntimeError):
    """The model state is on the host: call `offload.reload(chunks, optimizer)` first."""


class NotOffloadedError(RuntimeError):
    """`reload` was called on a model whose state was never offloaded."""


class UnsupportedWrapperError(TypeError):
    """The chunks are not wrapped in a data-parallel wrapper whose buffers the kit knows."""


@dataclass
class _Saved:
    kind: str
    full: torch.Tensor  # uint8 view of the whole device storage (the storage object we resize)
    host: torch.Tensor  # its bytes on the host (pinned when CUDA is available)


@dataclass
class OffloadState:
    """What `offload` moved; stored on the optimizer so `reload` finds it."""

    kinds: tuple
    saved: list = field(default_factory=list)
    undo: list = field(default_factory=list)  # callables removing the guards
    raw_chunks: list = field(default_factory=list)  # FSDP chunks whose compute params were installed
    offload_s: float = 0.0

    @property
    def bytes_by_kind(self) -> dict:
        out = dict.fromkeys(self.kinds, 0)
        for s in self.saved:
            out[s.kind] += s.host.numel()
        return out

    @property
    def nbytes(self) -> int:
        return sum(s.host.numel() for s in self.saved)


# ---- what to move --------------------------------------------------------------------------
def _check_wrappers(chunks) -> None:
    from megatron.core.distributed import DistributedDataParallel
    for i, chunk in enumerate(chunks):
        if not (is_fsdp(chunk) or isinstance(chunk, DistributedDataParallel)):
            raise UnsupportedWrapperError(
                f"chunk {i} is a {type(chunk).__name__}; offload/reload support megatron-core's "
                "FullyShardedDataParallel (EngineConfig(use_megatron_fsdp=True)) and DistributedDataParallel "
                "chunks as `engine.build` returns them")


def shard_tensors(chunks, optimizer) -> dict:
    """{kind: [local tensors]} this rank holds: the buffers megatron's views point into."""
    _check_wrappers(chunks)
    out = {k: [] for k in KINDS}
    for chunk in chunks:
        if is_fsdp(chunk):
            out["model_weights"] += list(fsdp_buffers([chunk], "model_weight_buffer"))
            out["main_weights"] += list(fsdp_buffers([chunk], "main_weight_buffer"))
            out["main_grads"] += list(fsdp_buffers([chunk], "main_grad_buffer"))
        else:  # DDP: param_data / grad_data of every bucket buffer
            buffers = list(chunk.buffers) + list(getattr(chunk, "expert_parallel_buffers", []) or [])
            out["model_weights"] += [b.param_data for b in buffers if b.param_data is not None]
            out["main_grads"] += [b.grad_data for b in buffers if b.grad_data is not None]
    if not all(is_fsdp(c) for c in chunks):
        out["main_weights"] += list(main_params(optimizer))
    for opt in inner_optimizers(optimizer):
        for state in opt.optimizer.state.values():
            out["optimizer_states"] += [v for v in state.values() if torch.is_tensor(v)]
    return {k: [local(t) for t in ts] for k, ts in out.items()}


def _distinct_storages(chunks, optimizer, kinds) -> list[tuple[str, torch.Tensor]]:
    """(kind, uint8 view of the whole storage) per distinct non-empty storage; first kind wins."""
    seen, out = set(), []
    for kind, tensors in shard_tensors(chunks, optimizer).items():
        if kind not in kinds:
            continue
        for t in tensors:
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            if storage.nbytes() == 0 or key in seen:
                continue
            if not storage.resizable():
                raise RuntimeError(f"a {kind} storage on {t.device} is not resizable (e.g. allocated from an "
                                   "NCCL user-buffer pool); offload cannot free it in place")
            seen.add(key)
            out.append((kind, torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)))
    return out


# ---- guards ----------------------------------------------------------------------------------
def _raiser(what: str):
    def guard(*args, **kwargs):
        raise OffloadedError(f"{what} while the model state is offloaded to the host; "
                             "call `offload.reload(chunks, optimizer)` first")
    return guard


def _shadow(obj, name: str, fn) -> callable:
    """Install `fn` as an instance attribute hiding `name`; return the undo. An instance attribute
    already there is put back (megatron's FSDP adapter binds `zero_grad_buffer` per instance to its
    inner MegatronFSDP's; deleting it would fall back to the adapter class's different method)."""
    had, old = name in vars(obj), vars(obj).get(name)
    setattr(obj, name, fn)
    return (lambda: setattr(obj, name, old)) if had else (lambda: delattr(obj, name))


def _install_guards(chunks, optimizer) -> list:
    undo = []
    for i, chunk in enumerate(chunks):
        hook = chunk.register_forward_pre_hook(lambda *a, i=i: _raiser(f"forward of chunk {i}")())
        undo += [hook.remove, _shadow(chunk, "zero_grad_buffer", _raiser(f"zero_grad_buffer of chunk {i}"))]
    undo += [_shadow(optimizer, "step", _raiser("optimizer.step()")),
             _shadow(optimizer, "zero_grad", _raiser("optimizer.zero_grad()"))]
    return undo


def is_offloaded(optimizer) -> bool:
    return getattr(optimizer, _ATTR, None) is not None


def assert_resident(chunks, optimizer) -> None:
    """Raise `OffloadedError` if `offload` moved this model's state off the device."""
    if is_offloaded(optimizer) and getattr(optimizer, _ATTR).kinds != OPTIMIZER_KINDS:
        _raiser("training")()


# ---- offload / reload ----------------------------------------------------------------------------
def offload(chunks, optimizer, *, kinds=KINDS, guard: bool = True) -> dict:
    """Move `kinds` of this rank's state to (pinned) host memory, freeing the device storages.

    FSDP chunks first finish their parameter all-gathers and release the unsharded buckets
    (`synchronize_param_gather`), so only the shards remain. Returns a dict: `bytes`, `seconds`, `gb_per_s` and
    `bytes_by_kind`."""
    if is_offloaded(optimizer):
        raise OffloadedError("already offloaded; call `offload.reload(chunks, optimizer)` before offloading again")
    _check_wrappers(chunks)
    state = OffloadState(kinds=tuple(kinds))
    start = time.perf_counter()
    for chunk in chunks:
        if param_view(chunk) == "compute":
            state.raw_chunks.append(chunk)
        set_param_view(chunk, "sharded")  # releases the all-gathered (unsharded) buckets
    _drop_optimizer_grads(chunks, optimizer)
    pin = torch.cuda.is_available()
    for kind, full in _distinct_storages(chunks, optimizer, state.kinds):
        host = torch.empty(full.numel(), dtype=torch.uint8, pin_memory=pin and full.is_cuda)
        host.copy_(full, non_blocking=True)
        state.saved.append(_Saved(kind, full, host))
    clock.synchronize()  # the copies must land before the device memory goes
    for s in state.saved:
        s.full.untyped_storage().resize_(0)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    state.offload_s = time.perf_counter() - start
    if guard:
        state.undo = _install_guards(chunks, optimizer)
    setattr(optimizer, _ATTR, state)
    return _stats(state.nbytes, state.offload_s, state.bytes_by_kind)


def _drop_optimizer_grads(chunks, optimizer) -> None:
    """Free the fp32 grads of the last optimizer step. With bf16 grads Megatron-FSDP's
    `update_main_grads` hands the optimizer fp32 copies of this rank's grad shard and keeps them in
    `param_and_grad_buffer.dist_main_grad` (4 B x params / N: 3.4 GB per GPU for 1.7 B on 2
    GPUs). They only feed the step that made them; the next step re-creates them. (With the default
    `OptimConfig.grad_upcast="by_part"` the step drops them itself, part by part; this finds none.)"""
    for chunk in chunks:
        fsdp.clear_main_grads(chunk)
    for opt in inner_optimizers(optimizer):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None


def reload(chunks, optimizer) -> dict:
    """Inverse of `offload`: re-allocate every freed storage and copy its bytes back (bitwise)."""
    state = getattr(optimizer, _ATTR, None)
    if state is None:
        raise NotOffloadedError("reload: not offloaded (call `offload.offload(chunks, optimizer)` first); "
                                "the model state is already on the device")
    start = time.perf_counter()
    for s in state.saved:
        s.full.untyped_storage().resize_(s.host.numel())
        s.full.copy_(s.host, non_blocking=True)
    clock.synchronize()
    for undo in state.undo:
        undo()
    for chunk in state.raw_chunks:  # compute params back in place
        set_param_view(chunk, "compute")
    delattr(optimizer, _ATTR)
    return _stats(state.nbytes, time.perf_counter() - start, state.bytes_by_kind)


def _stats(nbytes: int, seconds: float, by_kind: dict) -> dict:
    return dict(bytes=nbytes, seconds=seconds, gb_per_s=nbytes / max(seconds, 1e-9) / 1e9, bytes_by_kind=by_kind)


# ---- per-step optimizer offload (EngineConfig.offload.optimizer_offload) -----------------------------------
def stream_optimizer(chunks, optimizer) -> None:
    """Keep Adam's exp_avg/exp_avg_sq and the fp32 main weights on the host between steps.

    `optimizer.step()` becomes: reload them, step, offload them again. Weights and grads stay
    on the device (a forward/backward needs them), so no guards are installed. The device
    saves (4 + 8) B x params / N between steps and pays 2 x that over PCIe per step."""
    def streamed(inner_step, _owner):
        def step(*args, **kwargs):
            reload(chunks, optimizer)
            try:
                return inner_step(*args, **kwargs)
            finally:
                offload(chunks, optimizer, kinds=OPTIMIZER_KINDS, guard=False)
        return step

    step_pipeline.add(optimizer, stage="offload", wrap=streamed)   # the pipeline's "offload" stage
    offload(chunks, optimizer, kinds=OPTIMIZER_KINDS, guard=False)


def apply_config(cfg, chunks, optimizer):
    """Honour `cfg.offload.optimizer_offload` on a freshly built optimizer; returns it."""
    if cfg.offload.optimizer_offload:
        stream_optimizer(chunks, optimizer)
    return optimizer
