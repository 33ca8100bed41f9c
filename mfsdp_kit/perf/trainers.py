"""One training step of each variant behind one interface: megatron's engine, or torch FSDP2.

A `Trainer` hides how a variant steps, so a benchmark times `trainer.start(batch, i)` the same way
for all of them. The FSDP2 trainer is the reference Megatron-FSDP is measured against: the same
megatron GPT module, sharded by torch's `fully_shard` per TransformerLayer and then the root, fp32
sharded parameters cast to the compute dtype per unit (MixedPrecisionPolicy), fp32 gradient
reduction, torch AdamW (fused on GPU) - torchtitan's recipe, without the kit's engine.
"""
from __future__ import annotations

from collections import namedtuple

import torch
import torch.distributed as dist

from ..distributed import cross_entropy, engine, runtime
from ..config import EngineConfig, OptimConfig, bad_value
from ..train.data import random_token_batches
from ..distributed.introspect import local, torch_dtype
from ..distributed.memory import memory_report
from ..models.gpt import GPTSpec, gpt_model_fn
from ..train import Batch, StepOptions, start_step
from .peaks import PhasePeaks, record_step_phases
from .variants import fsdp2_options, optim_overrides, trainer_of, uses_megatron_finalize

Trainer = namedtuple("Trainer", "start memory settle")
"""start(batch, step_index) issues one step over a global batch and returns a function that reads its loss
(waiting for the step's GPU work), so a loop may start the next step first; memory() -> dict as
memory.memory_report; settle() waits for the communication a step may leave in flight (Megatron-FSDP's
prefetched all-gathers), so its handles are released now, not later by the garbage collector."""


def run_step(trainer: Trainer, batch: Batch, step_index: int) -> float:
    """One step, its loss read before returning."""
    return trainer.start(batch, step_index)()


def batches(spec: GPTSpec, *, n: int, global_batch: int, seed: int = 0) -> list[Batch]:
    """`n` global batches of random tokens at the spec's sequence length and vocabulary."""
    return random_token_batches(steps=n, global_batch=global_batch, seq_len_tokens=spec.seq_len_tokens,
                                vocab_size=spec.vocab_size, seed=seed)


def build_megatron(cfg: EngineConfig, spec: GPTSpec, *, options: StepOptions, peaks: PhasePeaks,
                   optim: dict | None = None, megatron_finalize: bool = False) -> Trainer:
    """megatron DDP or Megatron-FSDP (as `cfg` says) and megatron's (distributed) Adam, stepped by `train.start_step`
    with `options`; `optim`:
    OptimConfig fields over lr 1e-4, clip 1.0; `megatron_finalize`: megatron's finalize_model_grads
    instead of the kit's `engine.finalize_grads`."""
    chunks = engine.build(cfg, gpt_model_fn(spec, cfg))
    if megatron_finalize:
        from megatron.core.distributed import finalize_model_grads
        engine.unwrap_model(chunks[0]).config.finalize_model_grads_func = finalize_model_grads
    opt = engine.build_optimizer(chunks, OptimConfig(**{"lr": 1e-4, "clip_grad": 1.0, **(optim or {})}), cfg)
    record_step_phases(opt, peaks)

    def start(batch: Batch, i: int):
        pending = start_step(chunks, opt, batch, options=options, step_index=i)
        return lambda: pending.result().loss

    def settle() -> None:
        engine.synchronize_fsdp_params(chunks)  # waits for and drops pending all-gathers
        engine.restore_fsdp_params(chunks)
    return Trainer(start, lambda: memory_report(chunks, opt).as_dict(), settle)


def build_fsdp2(cfg: EngineConfig, spec: GPTSpec, *, options: StepOptions, peaks: PhasePeaks,
                keep_gathered: bool = False) -> Trainer:
    """The same megatron GPT under torch's fully_shard, stepped by torch AdamW, in padded micro-batches of
    `options.micro_batch_size` rows. `keep_gathered`: FSDP2's side of `fsdp_keep_gathered`, each unit gathered once a
    step (`reshard_after_forward=False`, and no reshard after the backward of any but the step's last micro-batch)."""
    if options.packed or options.max_tokens_per_micro_batch is not None:
        raise bad_value("packed", options.packed, "None or False for the fsdp2 trainer (it runs padded rows)")
    from megatron.core import tensor_parallel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    rt = runtime.current()
    model = gpt_model_fn(spec, cfg)(pre_process=True, post_process=True)
    if cfg.kernels.fused_cross_entropy:  # as engine.build does for the megatron wrappers
        cross_entropy.use_in(model)
    for p in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    model = model.float().to(rt.device)  # fp32 master weights; FSDP2 casts to the compute dtype per unit
    mesh = init_device_mesh(rt.device.type, (rt.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch_dtype(cfg.dtype), reduce_dtype=torch.float32)
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=not keep_gathered)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=not keep_gathered)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                            fused=rt.device.type == "cuda")

    def start(batch: Batch, i: int):
        opt.zero_grad(set_to_none=True)
        loss = fsdp2_forward_backward(model, batch, micro_batch_size=options.micro_batch_size,
                                      keep_gathered=keep_gathered)
        peaks.before_step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        peaks.after_step()
        return lambda: loss.item()
    return Trainer(start, lambda: fsdp2_memory(model, opt, spec), lambda: None)


def build_trainer(mode: str, cfg: EngineConfig, spec: GPTSpec, *, options: StepOptions,
                  peaks: PhasePeaks | None = None) -> Trainer:
    """The Trainer of variant `mode`: megatron's (ddp, fsdp and its variants) or torch FSDP2's, each step with
    `options` (`train.StepOptions`)."""
    peaks = peaks or PhasePeaks(record=False)
    if trainer_of(mode) == "fsdp2":
        return build_fsdp2(cfg, spec, options=options, peaks=peaks,
                           keep_gathered=fsdp2_options(mode, spec).get("keep_gathered", False))
    return build_megatron(cfg, spec, options=options, peaks=peaks, optim=optim_overrides(mode, spec),
                          megatron_finalize=uses_megatron_finalize(mode, spec))


def fsdp2_forward_backward(model, batch: Batch, *, micro_batch_size: int, keep_gathered: bool = False) -> torch.Tensor:
    """Per-token mean over the global batch (a 0-dim tensor on the device, unread), as train.step: sum /
    global tokens, grads averaged over ranks by FSDP2, hence the * world_size. `keep_gathered`: reshard only after
    the last micro-batch's backward."""
    rt = runtime.current()
    n = batch.num_sequences // rt.world_size
    mine = batch.slice(rt.rank * n, (rt.rank + 1) * n).to(rt.device)
    global_tokens = batch.loss_mask.sum().item()
    total = torch.zeros(2, dtype=torch.float64, device=rt.device)
    for i in range(0, n, micro_batch_size):
        mb = mine.slice(i, i + micro_batch_size)
        pos = torch.arange(mb.tokens.shape[1], device=rt.device).unsqueeze(0).expand_as(mb.tokens)
        per_token = model(mb.tokens, pos, None, labels=mb.labels)
        loss_sum = (per_token.float() * mb.loss_mask).sum()
        if keep_gathered:
            model.set_reshard_after_backward(i + micro_batch_size >= n)
        (loss_sum * rt.world_size / global_tokens).backward()
        total += torch.stack([loss_sum.detach().double(), mb.loss_mask.sum().double()])
    dist.all_reduce(total)
    return total[0] / total[1]


def fsdp2_memory(model, opt, spec: GPTSpec) -> dict:
    """The same fields as memory.memory_report: fp32 sharded params (= main weights), fp32 grads, moments."""
    nbytes = lambda t: local(t).numel() * local(t).element_size()  # noqa: E731
    params = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    states = sum(nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    model_state = params + grads + states
    return dict(params_bytes=params, grads_bytes=grads, main_params_bytes=0, optimizer_states_bytes=states,
                activations_peak_bytes=max(peak - model_state, 0), num_params=spec.param_count(),
                dp_size=dist.get_world_size(), model_state_bytes=model_state)
