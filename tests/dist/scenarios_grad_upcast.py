"""grad_upcast scenarios: Megatron-FSDP bf16 training with the fp32 grads made whole (megatron) or by part."""
from __future__ import annotations

import torch

from mfsdp_kit.distributed import engine, grad_upcast, offload, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.distributed.introspect import inner_optimizers, local
from mfsdp_kit.models import gpt_model_fn
from mfsdp_kit.train import step
from scenarios import SPEC, random_batches


def _losses_and_norms(chunks, opt, batches) -> tuple[list[float], list[float]]:
    results = [step(chunks, opt, b, micro_batch_size=2, step_index=i) for i, b in enumerate(batches)]
    return [r.loss for r in results], [r.grad_norm for r in results]


def _weight_bits(params) -> list[int]:
    """This rank's fp32 main weights as the bits of their floats: equal lists are bitwise-equal weights."""
    return torch.cat([local(p).detach().float().reshape(-1) for p in params]).view(torch.int32).tolist()


def train(*, upcast: str, part_bytes: int = grad_upcast.PART_BYTES, clip_grad: float = 1.0,
          adam_implementation: str = "auto", optimizer_offload: bool = False, tp: int = 1, steps: int = 4) -> dict:
    """`steps` bf16 steps of the scenarios' GPT under Megatron-FSDP; upcast="whole" | "by_part". Returns the
    losses, grad norms, this rank's fp32 main weights after the last step (as lists of floats' bits: exact),
    the most fp32 grad bytes alive at any Adam call, and the fp32 grad bytes alive right after backward."""
    cfg = EngineConfig(use_megatron_fsdp=True, dtype="bf16", seed=7, optimizer_offload=optimizer_offload,
                       tensor_model_parallel_size=tp)
    runtime.init(cfg)
    chunks = engine.build(cfg, gpt_model_fn(SPEC, cfg))
    ocfg = OptimConfig(lr=3e-3, clip_grad=clip_grad, adam_implementation=adam_implementation, grad_upcast="whole")
    opt = engine.build_optimizer(chunks, ocfg, cfg)
    installed = upcast == "by_part" and grad_upcast.install(chunks, opt, part_bytes=part_bytes)
    if installed:   # a second install changes nothing (else every part would be stepped once per part)
        installed = grad_upcast.install(chunks, opt, part_bytes=part_bytes) and grad_upcast.installed(chunks)
    torch_opt = opt.optimizer if hasattr(opt, "optimizer") else opt.chained_optimizers[0].optimizer
    params = [p for g in torch_opt.param_groups for p in g["params"]]
    seen = {"at_step": 0, "calls": 0}

    def fp32_grad_bytes() -> int:
        return sum(local(p.grad).numel() * 4 for p in params if p.grad is not None)

    def before_adam(*_):
        seen["at_step"] = max(seen["at_step"], fp32_grad_bytes())
        seen["calls"] += 1
    torch_opt.register_step_pre_hook(before_adam)
    after_backward = []
    finish = opt.step

    def step_watched():
        after_backward.append(fp32_grad_bytes())
        return finish()
    opt.step = step_watched
    pool = random_batches(steps=2, batch=8, seq=SPEC.seq_len_tokens, vocab=SPEC.vocab_size)
    losses, norms = _losses_and_norms(chunks, opt, [pool[i % 2] for i in range(steps)])
    if optimizer_offload:   # the main weights live on the host between steps
        offload.reload(chunks, opt)
    result = dict(installed=bool(installed), losses=losses, grad_norms=norms,
                  weight_bits=_weight_bits(params), max_fp32_grad_bytes=seen["at_step"],
                  adam_calls=seen["calls"], fp32_grad_bytes_after_backward=max(after_backward),
                  local_fp32_bytes=sum(local(p).numel() * 4 for p in params),
                  largest_param_bytes=max(local(p).numel() * 4 for p in params))
    runtime.shutdown()
    return result


def refused(*, fsdp: bool, dtype: str) -> bool:
    """Whether install declines (and changes nothing) for a wrapper / dtype where megatron makes no copy."""
    cfg = EngineConfig(use_megatron_fsdp=fsdp, dtype=dtype, seed=7)
    runtime.init(cfg)
    chunks = engine.build(cfg, gpt_model_fn(SPEC, cfg))
    opt = engine.build_optimizer(chunks, OptimConfig(grad_upcast="whole"), cfg)
    result = not grad_upcast.install(chunks, opt)
    runtime.shutdown()
    return result


def moe(*, upcast: str, workdir: str, arch: str = "Qwen3MoeForCausalLM", ep: int = 2) -> dict:
    """A tiny transformers-made MoE at expert-parallel size `ep` under Megatron-FSDP in bf16 (its expert params
    get their own optimizer in megatron's chain), the grad upcast chosen through OptimConfig; clip active."""
    from mfsdp_kit.models import hf
    from scenarios_moe import _batches, _source
    runtime.init(EngineConfig())   # rank 0 writes the source folder once
    src, _ = _source(arch, workdir)
    runtime.shutdown()
    cfg = EngineConfig(use_megatron_fsdp=True, expert_model_parallel_size=ep, dtype="bf16", seed=3)
    runtime.init(cfg)
    model = hf.load(src, cfg)
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-3, clip_grad=0.05, grad_upcast=upcast), cfg)
    losses, norms = _losses_and_norms(model.chunks, opt, _batches())
    params = [p for o in inner_optimizers(opt) for g in o.optimizer.param_groups for p in g["params"]]
    result = dict(installed=grad_upcast.installed(model.chunks), optimizers=len(inner_optimizers(opt)),
                  losses=losses, grad_norms=norms, weight_bits=_weight_bits(params))
    runtime.shutdown()
    return result


def resume(*, root: str, steps: int = 4, save_at: int = 2) -> dict:
    """bf16 Megatron-FSDP with the by-part step: `steps` straight (checkpoint at `save_at`), then a model built
    from another seed loads that checkpoint and trains the rest. Both loss lists, to compare bitwise."""
    from mfsdp_kit import checkpoint as ckpt
    from scenarios_ckpt import _batches, _build, _train
    cfg = EngineConfig(use_megatron_fsdp=True, dtype="bf16", seed=7)
    ocfg = OptimConfig(lr=3e-3, clip_grad=0.05, warmup_steps=1, decay_steps=steps)
    runtime.init(cfg)
    batches = _batches()
    chunks, opt, sched = _build(cfg, 7, ocfg)
    straight = _train(chunks, opt, sched, batches, 0, save_at)
    ckpt.CheckpointManager(root).save(save_at, chunks, opt, sched)
    straight += _train(chunks, opt, sched, batches, save_at, steps)
    installed = grad_upcast.installed(chunks)
    engine.release(chunks)
    chunks, opt, sched = _build(cfg, 1234, ocfg)
    ckpt.CheckpointManager(root).load(chunks, opt, sched, step=save_at)
    resumed = _train(chunks, opt, sched, batches, save_at, steps)
    runtime.shutdown()
    return dict(installed=installed and grad_upcast.installed(chunks), straight=straight[save_at:], resumed=resumed)
