"""Training scenarios on the embedded tiny model and arithmetic task (run by launch.run)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from mfsdp_kit.train import data, generate
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.distributed.memory import memory_report
from mfsdp_kit.models.hf import load
from mfsdp_kit.models.tiny import tiny
from mfsdp_kit.train import fit, forward_backward


def tiny_world(*, fsdp: bool, workdir: str, seed: int = 0):
    """Join the world (FSDP or DDP) and write the embedded xs model once: (cfg, HF path, tokenizer)."""
    from transformers import AutoTokenizer
    cfg = EngineConfig(use_megatron_fsdp=fsdp, seed=seed)
    rt = runtime.init(cfg)
    src = f"{workdir}/tiny_xs"
    if rt.rank == 0:
        tiny(src, size="xs", seed=0)
    dist.barrier()
    return cfg, src, AutoTokenizer.from_pretrained(src)


def _setup(*, fsdp: bool, workdir: str, seed: int = 0):
    cfg, src, tok = tiny_world(fsdp=fsdp, workdir=workdir, seed=seed)
    return cfg, load(src, cfg), tok


def sft(*, fsdp: bool, workdir: str, steps: int, global_batch: int, micro_batch_size: int, lr: float = 3e-3,
        evaluate: bool = True) -> dict:
    """SFT on 1-digit addition; held-out exact match before and after."""
    cfg, model, tok = _setup(fsdp=fsdp, workdir=workdir)
    task = data.ArithmeticTask(digits=1)
    heldout = task.rl_prompts(10, split="heldout")
    ocfg = OptimConfig(lr=lr, warmup_steps=10)
    opt = engine.build_optimizer(model.chunks, ocfg, cfg)
    sched = engine.build_scheduler(opt, ocfg, total_steps=steps)
    before = generate.evaluate(model.chunks, tok, heldout, reward_fn=data.verify) if evaluate else None
    batches = data.batches(task.train_pairs(90), tok, seq_len_tokens=16, global_batch=global_batch, seed=1)
    history = fit(model.chunks, opt, batches, steps=steps, micro_batch_size=micro_batch_size, scheduler=sched,
                  progress=False)
    after = generate.evaluate(model.chunks, tok, heldout, reward_fn=data.verify) if evaluate else None
    report = memory_report(model.chunks, opt)
    runtime.shutdown()
    return dict(loss=history.loss, lr=history.lr, grad_norm=history.grad_norm,
                accuracy_before=before and before["accuracy"], accuracy_after=after and after["accuracy"],
                samples=after and after["samples"], memory=report.as_dict())


def first_step_grads(*, micro_batch_size: int, workdir: str) -> dict:
    """Gradients of one global batch of 8 sequences per rank, split into micro-batches."""
    cfg, model, tok = _setup(fsdp=False, workdir=workdir)
    task = data.ArithmeticTask(digits=1)
    batch = next(data.batches(task.train_pairs(90), tok, seq_len_tokens=16, global_batch=16, seed=2))
    for c in model.chunks:
        c.zero_grad_buffer()
    loss, tokens, _ = forward_backward(model.chunks, batch, micro_batch_size=micro_batch_size)
    grads = torch.cat([b.grad_data.flatten() for c in model.chunks for b in c.buffers])
    runtime.shutdown()
    return dict(loss=loss, tokens=tokens, grads=grads.tolist())


def nonfinite_stops(*, fsdp: bool, workdir: str, bad_step: int = 2) -> dict:
    """A loss that turns NaN at `bad_step` must stop training with an error naming that step."""
    from mfsdp_kit.train import NonFiniteLossError, masked_token_loss, step
    cfg, model, tok = _setup(fsdp=fsdp, workdir=workdir)
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-3), cfg)
    batches = data.batches(data.ArithmeticTask(digits=1).train_pairs(90), tok, seq_len_tokens=16, global_batch=8)
    poison = {"on": False}

    def loss_fn(mb, token_losses):
        loss, count, logged = masked_token_loss(mb, token_losses)
        return (loss * float("nan"), count, logged) if poison["on"] else (loss, count, logged)

    result = dict(completed=0, error=None)
    try:
        for i in range(4):
            poison["on"] = i == bad_step
            step(model.chunks, opt, next(batches), micro_batch_size=4, step_index=i, loss_fn=loss_fn)
            result["completed"] += 1
    except NonFiniteLossError as e:
        result["error"] = str(e)
    runtime.shutdown()
    return result


def start_step_pipelined(*, fsdp: bool, workdir: str) -> dict:
    """train.run_steps (step i+1 started before step i is read), grads clipped (clip_grad 0.05),
    against `step` on a twin model: (loss, grad norm) per step of each."""
    from mfsdp_kit import train
    cfg, model, tok = _setup(fsdp=fsdp, workdir=workdir)
    twin = load(f"{workdir}/tiny_xs", cfg)
    opts = [engine.build_optimizer(m.chunks, OptimConfig(lr=1e-3, clip_grad=0.05), cfg) for m in (model, twin)]
    stream = data.batches(data.ArithmeticTask(digits=1).train_pairs(40), tok, seq_len_tokens=16, global_batch=8)
    batches = [next(stream) for _ in range(3)]   # an endless stream
    piped = train.run_steps(model.chunks, opts[0], batches, micro_batch_size=4)
    alone = [train.step(twin.chunks, opts[1], b, micro_batch_size=4, step_index=i) for i, b in enumerate(batches)]
    runtime.shutdown()
    return dict(piped=[(r.loss, r.grad_norm) for r in piped], alone=[(r.loss, r.grad_norm) for r in alone])
