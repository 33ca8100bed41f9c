"""Build, wrap, done: model chunks wrapped in DDP or Megatron-FSDP, and their optimizer.

`build` follows megatron's own `get_model`: one chunk per virtual-pipeline stage, moved to
the device, the mixed-precision wrapper (Float16Module) for bf16/fp16, then DDP or
megatron-core's `FullyShardedDataParallel` adapter (Megatron-FSDP) as `cfg` says.
Every wrapper class is stripped by `unwrap_model`. Which parameters an FSDP chunk shows, its
sharded DTensors or its unsharded compute tensors, is switched here only: `params_view` (and its
two halves `synchronize_fsdp_params` / `restore_fsdp_params`), always for every chunk (verl's
first version stopped after one).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Protocol

import torch

from .. import compat
from . import cross_entropy, grad_upcast, runtime
from ..config import hsdp
from ..compat.access import bridge_model, fsdp, fsdp_unit
from ..config import EngineConfig, LoRAConfig, OptimConfig, ddp_config
from .introspect import (all_gather_pipelines, grad_scalers, inner_optimizers, is_fsdp, local, param_view,
                         set_param_view, torch_dtype)


class ModelProvider(Protocol):
    """Anything with megatron-bridge's `provide(pre_process, post_process, vp_stage)`."""

    def provide(self, pre_process: bool | None = None, post_process: bool | None = None,
                vp_stage: int | None = None) -> torch.nn.Module: ...


ModelFn = Callable[..., torch.nn.Module]


def _wrapper_classes() -> tuple[type, ...]:
    from megatron.core.distributed import DistributedDataParallel, FullyShardedDataParallel
    from megatron.core.transformer.module import Float16Module
    return DistributedDataParallel, FullyShardedDataParallel, fsdp.megatron_fsdp_class(), Float16Module


def _provide(model_fn: ModelProvider | ModelFn, vp_stage: int | None) -> torch.nn.Module:
    from megatron.core import parallel_state as ps
    ignore_virtual = vp_stage is None
    kwargs = dict(pre_process=ps.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage),
                  post_process=ps.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage),
                  vp_stage=vp_stage)
    fn = model_fn.provide if hasattr(model_fn, "provide") else model_fn
    return fn(**kwargs)


def build(cfg: EngineConfig, model_fn: ModelProvider | ModelFn, *, wrap: bool = True) -> list[torch.nn.Module]:
    """Model chunks for this rank: built, on the device, mixed-precision wrapped, DDP/FSDP wrapped.

    `model_fn(pre_process=, post_process=, vp_stage=)` (or a provider's `.provide`) builds one
    chunk. `wrap=False` stops before the data-parallel wrapper (for reference models that
    only run forward, and for loading weights before sharding). With `cfg.lora` and `wrap`, the adapters go
    onto the built model before the wrap (`add_adapters`; `models.hf.load` adds them after loading weights).
    With `cfg.kernels.fused_cross_entropy`, each chunk computes its loss with `cross_entropy.use_in`.
    """
    rt = runtime.current()
    vpp = cfg.parallelism.virtual_pipeline_model_parallel_size
    stages = list(range(vpp)) if vpp else [None]
    chunks = []
    for vp_stage in stages:
        module = _provide(model_fn, vp_stage)
        if cfg.kernels.fused_cross_entropy:
            cross_entropy.use_in(module)   # the loss from bf16 logits (distributed/cross_entropy.py)
        for p in module.parameters():  # megatron's get_model: TP attributes on every param
            from megatron.core import tensor_parallel
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
        module = module.to(rt.device)
        # Loss = per-token mean over the whole global batch: DDP/FSDP then reduce grad SUMS and
        # finalize_model_grads divides by the global token count (see train.py).
        module.config.calculate_per_token_loss = True
        if cfg.dtype in ("bf16", "fp16"):
            from megatron.core.transformer.module import Float16Module
            module = Float16Module(module.config, module)
        chunks.append(module)
    if wrap and cfg.lora is not None:
        add_adapters(chunks, lora=cfg.lora)
    return wrap_chunks(cfg, chunks) if wrap else chunks


def add_adapters(chunks: list[torch.nn.Module], *, lora: LoRAConfig) -> list[torch.nn.Module]:
    """LoRA adapters (`EngineConfig.lora`) into the plain (unwrapped) `chunks` through Megatron-Bridge's PEFT, every
    other parameter frozen; returns `chunks` (`lora.apply` is this plus the base's reference).

    Here, beside the wrap, because it must precede it: DDP and Megatron-FSDP lay out their grad buffers from each
    parameter's `requires_grad` when they wrap (`lora`'s docstring says what each then does with the frozen base).
    `build` calls it, and `models.hf.load` after loading the weights."""
    compat.apply("bridge")
    compat.apply("peft")
    compat.apply("fsdp_frozen")   # for a later Megatron-FSDP wrap
    LoRA = bridge_model.lora_class()
    lora.validate()
    peft = LoRA(target_modules=lora.megatron_targets(), dim=lora.rank, alpha=lora.alpha, dropout=lora.dropout)
    peft(chunks, training=True)
    return chunks


def wrap_chunks(cfg: EngineConfig, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Wrap built chunks (e.g. after loading weights into them) and attach the schedule hooks."""
    chunks = [wrap_chunk(cfg, c, index=i) for i, c in enumerate(chunks)]
    attach_schedule_hooks(chunks)
    if cfg.wrapper.fsdp_keep_gathered:   # train steps then hold what they gather (keep_gathered.held)
        for pipeline in all_gather_pipelines(chunks):
            compat.apply("keep_gathered", pipeline=pipeline)
    return chunks


def finalize_grads(model: list[torch.nn.Module], num_tokens: torch.Tensor | None = None, pg_collection=None,
                   force_all_reduce: bool = False) -> None:
    """megatron's `finalize_model_grads` (gradient sync, then the per-token scale), with the scale left on the
    device. megatron 0.16.1 scales by `1 / num_tokens` only `if num_tokens > 0` (finalize_model_grads.py:495):
    that test reads the GPU's token count on the host, so the host waits for backward to finish, and the GPU
    then idles while the host issues the optimizer step (docs/benchmarks.md, levers4). `clamp(min=1)` gives
    the same grads: the scale is the same tensor value, and with no token in the loss every grad is 0."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel.utils import get_pp_last_rank
    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    if num_tokens is None:
        return
    pp_group = pg_collection.pp if pg_collection is not None else ps.get_pipeline_model_parallel_group()
    dp_cp_group = (pg_collection.dp_cp if pg_collection is not None
                   else ps.get_data_parallel_group(with_context_parallel=True))
    torch.distributed.broadcast(num_tokens, src=get_pp_last_rank(pp_group), group=pp_group)  # the last stage counts
    torch.distributed.all_reduce(num_tokens, group=dp_cp_group)
    scaling = 1.0 / num_tokens.clamp(min=1)
    for chunk in model:
        chunk.scale_gradients(scaling)


def attach_schedule_hooks(chunks: list[torch.nn.Module]) -> None:
    """The hooks megatron's schedules call, as megatron's training.py sets them (`finalize_grads` for
    megatron's `finalize_model_grads`: the same, without its host sync), on the model config of `chunks`. Models
    built by one `model_fn` share that config, so `train.start_step` sets them again before each step: a step enters
    its own model's `no_sync`, not the last-built one's."""
    config = unwrap_model(chunks[0]).config
    config.finalize_model_grads_func = finalize_grads
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync


def wrap_chunk(cfg: EngineConfig, module: torch.nn.Module, *, index: int = 0) -> torch.nn.Module:
    """Wrap one (mixed-precision wrapped) chunk in DDP or Megatron-FSDP according to `cfg`."""
    from megatron.core.distributed import DistributedDataParallel, FullyShardedDataParallel
    config = unwrap_model(module).config
    hsdp.check_model(cfg, config)
    dcfg = ddp_config(cfg)
    if cfg.wrapper.use_megatron_fsdp:
        if dcfg.suggested_communication_unit_size is None:   # megatron's own default is 1e9 (compat.access.fsdp_unit)
            dcfg.suggested_communication_unit_size = fsdp_unit.unit_elements(
                module, sharding_strategy=dcfg.data_parallel_sharding_strategy)
        return FullyShardedDataParallel(config=config, ddp_config=dcfg, module=module,
                                        device=runtime.current().device)
    # As megatron's get_model: only the first chunk buckets (later chunks overlap differently).
    return DistributedDataParallel(config=config, ddp_config=dcfg, module=module, disable_bucketing=index > 0)


def unwrap_model(model):
    """Strip DDP, FullyShardedDataParallel, MegatronFSDP and Float16Module; lists map element-wise."""
    if isinstance(model, (list, tuple)):
        return [unwrap_model(m) for m in model]
    wrappers = _wrapper_classes()
    while isinstance(model, wrappers):
        model = model.module
    return model


def module_device(chunk: torch.nn.Module) -> torch.device:
    """Device of a chunk's weights: works for FSDP (DTensor shards, `.buffers` not a list) and
    for chunks without buffers or parameters (falls back to the runtime's device)."""
    for p in chunk.parameters():
        return local(p).device
    buffers = getattr(chunk, "buffers", None)
    if isinstance(buffers, list) and buffers:
        return buffers[0].param_data.device
    return runtime.current().device


def local_numel(chunks: Iterable[torch.nn.Module]) -> int:
    """Parameter elements this rank holds (FSDP: its shards; DDP: everything)."""
    total = 0
    for chunk in chunks:
        for p in chunk.parameters():
            total += local(p).numel()
    return total


def global_numel(chunks: Iterable[torch.nn.Module]) -> int:
    """Parameter elements of the whole model chunk (DTensors report their global size)."""
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())


def synchronize_fsdp_params(chunks: Iterable[torch.nn.Module]) -> int:
    """Make every FSDP chunk's parameters the DTensor shards of its latest optimized weights.

    Waits for in-flight parameter all-gathers and swaps the module's parameters to the
    distributed (sharded) view, so `named_parameters()` yields DTensors that exporters gather
    one at a time. Returns how many chunks it synced (0 for DDP, which needs nothing).
    """
    return sum(set_param_view(chunk, "sharded") for chunk in chunks)


def restore_fsdp_params(chunks: Iterable[torch.nn.Module]) -> int:
    """Inverse of `synchronize_fsdp_params`: put the unsharded compute parameters back for the
    next forward/backward. Returns how many chunks it restored."""
    return sum(set_param_view(chunk, "compute") for chunk in chunks)


@contextlib.contextmanager
def params_view(chunks: Iterable[torch.nn.Module], view: str) -> Iterator[None]:
    """Show every FSDP chunk's parameters as `view` ("sharded" | "compute") inside the block, then
    put back the view each chunk showed before. DDP chunks are left alone.

    Why it matters: the optimizer is built from, and steps, the sharded view; exporters gather
    the sharded DTensors; `sync` converts the compute view; a forward installs the compute view.
    """
    chunks = list(chunks)
    before = [(chunk, param_view(chunk)) for chunk in chunks if is_fsdp(chunk)]
    for chunk in chunks:
        set_param_view(chunk, view)
    try:
        yield
    finally:
        for chunk, old in before:
            set_param_view(chunk, old)


def settle_param_gathers(chunks: Iterable[torch.nn.Module]) -> None:
    """On CPU, finish the parameter all-gathers Megatron-FSDP prefetched for the next forward.

    Megatron-FSDP always issues them asynchronously and leaves some in flight after a forward or
    a step (overlap on GPU). Under gloo they write into bucket memory from gloo's thread while
    later code may free it; our CPU stream/event stand-ins order nothing. `compat.patches.cpu` now makes
    the gathers inside Megatron-FSDP's coalescing blocks synchronous (that ended the remaining
    SIGSEGV / SIGABRT in longer CPU runs), so this only marks prefetched buckets ready; it stays
    as the guard for any gather issued outside those blocks. No-op on GPU.
    """
    if torch.cuda.is_available():
        return
    for pipeline in all_gather_pipelines(chunks):
        fsdp.settle_gathers(pipeline)


def release(chunks: Iterable[torch.nn.Module]) -> None:
    """Make a model freeable before you drop it (a notebook that rebuilds models in one process).

    megatron-core 0.16.1 keeps a dropped Megatron-FSDP model alive: every parameter's
    grad-accumulation hook closes over the wrapper (a cycle through C++ that gc cannot break,
    megatron_fsdp.py `_register_fsdp_hooks`), and `RotaryEmbedding.forward` is an lru_cache whose
    keys hold the module (rotary_pos_embedding.py:177). This removes those hooks and clears that
    cache; the chunks cannot train afterwards. `chunks` may also hold bare MegatronFSDP modules
    (a benchmark that finds them with gc). Drop your references (chunks, optimizer), then
    `gc.collect()` frees the memory.
    """
    import sys
    rotary = sys.modules.get("megatron.core.models.common.embeddings.rotary_pos_embedding")
    if rotary is not None:
        rotary.RotaryEmbedding.forward.cache_clear()
    fsdp.remove_grad_hooks(chunks)


def build_optimizer(chunks: list[torch.nn.Module], ocfg: OptimConfig, cfg: EngineConfig):
    """Megatron's optimizer (Adam, distributed when `cfg.wrapper.use_distributed_optimizer`) for `chunks`."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    ocfg.validate()
    # The optimizer collects `chunk.parameters()`: for FSDP they must be the sharded (DTensor)
    # view it steps, not the compute params a forward leaves installed (else: zero grads).
    synchronize_fsdp_params(chunks)
    config = OptimizerConfig(
        optimizer="adam", lr=ocfg.lr, min_lr=ocfg.min_lr, weight_decay=ocfg.weight_decay,
        adam_beta1=ocfg.adam_beta1, adam_beta2=ocfg.adam_beta2, adam_eps=ocfg.adam_eps,
        clip_grad=ocfg.clip_grad, bf16=cfg.dtype == "bf16", fp16=cfg.dtype == "fp16",
        params_dtype=torch_dtype(cfg.dtype), use_distributed_optimizer=cfg.wrapper.use_distributed_optimizer)
    optimizer = get_megatron_optimizer(config, chunks, use_gloo_process_groups=False)
    scale_loss_by(chunks, optimizer)
    set_adam_implementation(optimizer, ocfg.adam_implementation)
    if ocfg.grad_upcast == "by_part":
        grad_upcast.install(chunks, optimizer)
    from .offload import apply_config  # optimizer_offload: states + main weights live on the host
    return apply_config(cfg, chunks, optimizer)


def scale_loss_by(chunks: list[torch.nn.Module], optimizer) -> None:
    """fp16: point the model config's `grad_scale_func` at `optimizer.scale_loss`. megatron's schedule scales the loss
    only through that hook (megatron.training sets it at setup); without it the step unscales unscaled gradients.
    `build_optimizer` sets it and `train.start_step` sets it again before each step: models built by one `model_fn`
    (a policy and its critic) share one TransformerConfig, and each must scale by its own optimizer. bf16 and fp32
    optimizers have no loss scale: nothing is set."""
    from megatron.core.utils import get_model_config
    if grad_scalers(optimizer):
        get_model_config(chunks[0]).grad_scale_func = optimizer.scale_loss


def set_adam_implementation(optimizer, implementation: str) -> None:
    """Switch the torch Adam(W) inside megatron's optimizer to "fused" or "foreach" kernels
    ("auto": fused where every param is on a GPU, else torch's own choice).

    get_megatron_optimizer passes no `fused=`; Adam reads `fused`/`foreach` from each param group
    at every step and creates its state lazily at the first one, so setting them before that step
    is what constructing it with `fused=True` would have done."""
    for opt in inner_optimizers(optimizer):
        torch_opt = getattr(opt, "optimizer", None)
        if torch_opt is None:   # a chain member without params on this rank
            continue
        if not isinstance(torch_opt, torch.optim.Adam):   # AdamW is an Adam
            raise TypeError(f"adam_implementation needs torch's Adam(W) inside megatron's optimizer, got "
                            f"{type(torch_opt).__name__} (TE or apex installed?)")
        on_gpu = all(p.is_cuda for g in torch_opt.param_groups for p in g["params"])
        if implementation == "auto" and not on_gpu:
            continue   # torch's own choice
        fused = implementation == "fused" or implementation == "auto"   # torch checks devices/dtypes at step 1
        for group in [torch_opt.defaults, *torch_opt.param_groups]:
            group["fused"], group["foreach"] = fused, not fused


def build_scheduler(optimizer, ocfg: OptimConfig, *, total_steps: int | None = None):
    """Megatron's OptimizerParamScheduler: linear warm-up, then constant or cosine decay."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    decay = ocfg.decay_steps if ocfg.decay_steps is not None else (total_steps or 1) - ocfg.warmup_steps
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if ocfg.warmup_steps else ocfg.lr, max_lr=ocfg.lr, min_lr=ocfg.min_lr,
        lr_warmup_steps=ocfg.warmup_steps, lr_decay_steps=ocfg.warmup_steps + max(decay, 1),
        lr_decay_style="cosine" if ocfg.decay_steps else "constant",
        start_wd=ocfg.weight_decay, end_wd=ocfg.weight_decay, wd_incr_steps=1, wd_incr_style="constant")
