"""MoE with expert parallelism: tiny transformers-made MoE models, each through four layouts in the same
ranks (EP 1 | 2 x DDP | Megatron-FSDP; `runtime.shutdown` keeps the world, `init` builds the next).

Per layout: load -> logits vs HF (models.verify) -> export exact vs the HF source (experts gathered
across the EP group) -> the loss vs transformers' on the same batch -> a few training steps (losses,
grad norms) -> export after training (HF names and shapes, the weights moved) -> at EP 2, save_hf and
transformers' logits of the saved folder vs the live model's -> checkpoint save -> load into a freshly
loaded model -> every local model/optimizer/RNG tensor bitwise equal. Rank 0's dict holds every
number, keyed by layout name ("ep1-ddp", ...).
"""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from mfsdp_kit import checkpoint as ckpt
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.weights import sync
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.train.data import random_token_batches
from mfsdp_kit.models import archs, hf as hf_models
from mfsdp_kit.train.generate import logits
from mfsdp_kit.models.verify import fixed_tokens, hf_logits, verify
from mfsdp_kit.train import forward_backward, step
from scenarios_arch import hf_loss  # noqa: E402  (tests/dist is on the path)
from scenarios_ckpt import _compare, local_snapshot  # noqa: E402

LAYOUTS = {"ep1-ddp": (1, False), "ep1-fsdp": (1, True), "ep2-ddp": (2, False), "ep2-fsdp": (2, True)}
OCFG = OptimConfig(lr=1e-3, warmup_steps=1, decay_steps=10)
VOCAB, STEPS, GLOBAL_BATCH, MICRO, SEQ = 256, 3, 4, 2, 16


def _source(arch: str, workdir: str) -> tuple[str, dict]:
    """The tiny HF folder (rank 0 writes it once) and its tensors."""
    from safetensors.torch import load_file
    src = f"{workdir}/{arch}_moe"
    if dist.get_rank() == 0 and not os.path.exists(f"{src}/config.json"):
        archs.write_tiny(arch, src, vocab_size=VOCAB)
    dist.barrier()
    original = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            original.update(load_file(f"{src}/{f}"))
    return src, original


def _export_vs(model, original: dict) -> dict:
    exported = dict(sync.export_hf_weights(model.chunks, model.bridge))
    same_shape = [k for k in original if k in exported and exported[k].shape == original[k].shape]
    return dict(export_names_match=sorted(exported) == sorted(original),
                export_shapes_match=len(same_shape) == len(original),
                export_maxdiff=max((exported[k] - original[k]).abs().max().item() for k in same_shape))


def _expert_counts(model) -> dict:
    """Local experts of layer 0 on this rank and the ranks of its expert-data-parallel group."""
    from megatron.core import parallel_state as ps
    experts = engine.unwrap_model(model.chunks[0]).decoder.layers[0].mlp.experts
    return dict(local_experts=experts.num_local_experts, ep_size=ps.get_expert_model_parallel_world_size(),
                expert_dp_size=ps.get_expert_data_parallel_world_size())


def _batches():
    return random_token_batches(steps=STEPS, global_batch=GLOBAL_BATCH, seq_len_tokens=SEQ, vocab_size=VOCAB,
                                seed=9)


def _saved_folder_logits(model, out: str) -> dict:
    """save_hf from the live (sharded, expert-parallel) chunks; transformers' logits of it vs the live ones."""
    sync.save_hf(model.chunks, model.bridge, out)
    tokens = fixed_tokens(VOCAB)
    live = logits(model.chunks, tokens, vocab_size=VOCAB)
    if dist.get_rank() != 0:
        return {}
    diff = (hf_logits(out, tokens) - live).abs().max().item()
    return dict(reload_relative=diff / live.abs().max().item())


def _layout(arch: str, src: str, original: dict, *, ep: int, fsdp: bool, root: str, train_only: bool = False) -> dict:
    """Every check of the module docstring; `train_only`: the training alone (losses and grad norms)."""
    cfg = EngineConfig(use_megatron_fsdp=fsdp, expert_model_parallel_size=ep, dtype="fp32", seed=3)
    runtime.init(cfg)
    t0 = time.perf_counter()
    model = hf_models.load(src, cfg)
    out = dict(wrapper=type(model.chunks[0]).__name__)
    batches = _batches()
    if not train_only:
        out.update(verify=verify(model).as_dict(), **_expert_counts(model))
        out.update(_export_vs(model, original))
        out["megatron_loss"] = forward_backward(model.chunks, batches[0], micro_batch_size=MICRO,
                                                forward_only=True)[0]
    opt = engine.build_optimizer(model.chunks, OCFG, cfg)
    sched = engine.build_scheduler(opt, OCFG)
    results = [step(model.chunks, opt, b, micro_batch_size=MICRO, scheduler=sched, step_index=i)
               for i, b in enumerate(batches)]
    out.update(losses=[r.loss for r in results], grad_norms=[r.grad_norm for r in results])
    if train_only:
        engine.release(model.chunks)
        runtime.shutdown()
        return out
    from mfsdp_kit.distributed.memory import memory_report   # counts DDP's expert-parallel buffers too
    out["memory_params_bytes"] = memory_report(model.chunks, opt).params_bytes
    out["local_params_bytes"] = sum(p.numel() * p.element_size() for c in engine.unwrap_model(model.chunks)
                                    for p in c.parameters())
    out["trained_export"] = _export_vs(model, original)
    if ep > 1:
        out.update(_saved_folder_logits(model, f"{root}_hf"))
    manager = ckpt.CheckpointManager(root)
    manager.save(STEPS, model.chunks, opt, sched)
    before = local_snapshot(model.chunks, opt, fsdp)
    fresh = hf_models.load(src, cfg)   # the source weights again: the checkpoint must replace them all
    fresh_opt = engine.build_optimizer(fresh.chunks, OCFG, cfg)
    fresh_sched = engine.build_scheduler(fresh_opt, OCFG)
    manager.load(fresh.chunks, fresh_opt, fresh_sched)
    out["checkpoint"] = _compare(before, local_snapshot(fresh.chunks, fresh_opt, fsdp))
    out["seconds"] = time.perf_counter() - t0
    engine.release(model.chunks + fresh.chunks)
    runtime.shutdown()
    return out


def moe_layouts(*, archs: list[str], workdir: str, layouts: list[str] | None = None, train_only: bool = False) -> dict:
    """{arch: {"hf_loss": .., layout: ..}}: every layout of LAYOUTS (or the named ones) of each
    architecture's tiny model, one after another in these processes (one job: one startup).
    `train_only`: each layout's training alone, for a run that reads only the losses (no hf_loss either)."""
    runtime.init(EngineConfig())
    result = {}
    for arch in archs:
        src, original = _source(arch, workdir)
        result[arch] = {} if train_only else {"hf_loss": hf_loss(src, _batches()[0])}
        for name in layouts or list(LAYOUTS):
            ep, fsdp = LAYOUTS[name]
            result[arch][name] = _layout(arch, src, original, ep=ep, fsdp=fsdp, root=f"{workdir}/ckpt_{arch}_{name}",
                                         train_only=train_only)
        runtime.init(EngineConfig())   # the next architecture's source is written under a plain layout
    return result


def to_hf_equals_save_hf(*, archs: list[str], workdir: str, layout: str = "ep2-fsdp") -> dict:
    """One process: `checkpoint.to_hf` of each arch's `layout` checkpoint (rebuilt at world 1, EP 1) vs the
    folder `save_hf` wrote from the live EP 2 model at the same step: the largest |difference| per arch."""
    from safetensors.torch import load_file
    out = {}
    for arch in archs:
        root = f"{workdir}/ckpt_{arch}_{layout}"
        path = ckpt.to_hf(f"{root}/step_{STEPS:06d}", f"{root}_to_hf", hf_source=f"{workdir}/{arch}_moe")
        a, b = load_file(f"{path}/model.safetensors"), load_file(f"{root}_hf/model.safetensors")
        out[arch] = dict(names_match=sorted(a) == sorted(b),
                         maxdiff=max((a[k] - b[k]).abs().max().item() for k in a if k in b))
    return out
