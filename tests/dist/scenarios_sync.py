"""Rollout weight sync on the torchrun world: the planned path (`weights.plan`) against the bridge path.

`sync_paths`: load an HF folder into DDP or Megatron-FSDP chunks, sync into two rollout models (one
by the plan, one by the bridge), train a step, sync again (the plan is reused; one more sync counts
the aten ops a warm replay dispatches), replace one rollout parameter (the plan is rebuilt), then sync a third rollout model with the plan's recognisers
sabotaged (wrong views that keep the shapes, QKV unknown): those tensors must fall back to the
bridge and everything must still be exact. Rank 0's dict holds max|diff| numbers (0.0 = bitwise
equal) and the paths' tensor counts.
"""
from __future__ import annotations

import collections
import os
from functools import partial

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from mfsdp_kit.distributed import runtime
from mfsdp_kit.weights import sync, plan as sync_plan, views as sync_views
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.train.data import random_token_batches
from mfsdp_kit.distributed.engine import build_optimizer
from mfsdp_kit.models import archs, hf as hf_models
from mfsdp_kit.models.tiny import tiny
from mfsdp_kit.train import step


def _max_diff(a: dict, b: dict) -> float:
    """max|a - b| over b's names; inf when a name or a shape is missing."""
    worst = 0.0
    for k, v in b.items():
        if k not in a or a[k].shape != v.shape:
            return float("inf")
        worst = max(worst, (a[k].float() - v.float()).abs().max().item())
    return worst


class _OpCount(TorchDispatchMode):
    """aten ops dispatched inside the block, by name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _zeroed_rollout(src: str):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def _sabotaged() -> dict:
    """Mislead recognised(), returning what to restore: gate and up swapped and norm weights
    reversed (right shapes, wrong elements: only the probe check can tell; the folder's norm
    weights are all ones, so a check on real values would pass them), QKV unknown."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping, QKVMapping
    table = sync_views.recognised()
    saved = dict(table)
    direct = table[AutoMapping]

    def reversed_norms(mapping, module):
        if str(mapping.hf_param).endswith("norm.weight"):
            return {str(mapping.hf_param): lambda full: full.flip(0)}
        return direct(mapping, module)

    table[AutoMapping] = reversed_norms
    table[GatedMLPMapping] = lambda m, module: {m.hf_param["gate"]: partial(sync_views.half, index=1),
                                                m.hf_param["up"]: partial(sync_views.half, index=0)}
    del table[QKVMapping]
    return saved


def sync_paths(*, arch: str, fsdp: bool, workdir: str, sabotage: bool = True, overrides: dict | None = None,
               ddp: dict | None = None) -> dict:
    cfg = EngineConfig(use_megatron_fsdp=fsdp, dtype="fp32", seed=3, override_ddp_config=ddp or {})
    rt = runtime.init(cfg)
    src = f"{workdir}/{arch}{'_' + '_'.join(sorted(overrides)) if overrides else ''}"
    if rt.rank == 0 and not os.path.exists(f"{src}/config.json"):
        tiny(src, arch="qwen2", size="xs") if arch == "tiny-qwen2" else archs.write_tiny(arch, src, **(overrides or {}))
    dist.barrier()
    model = hf_models.load(src, cfg)
    from safetensors.torch import load_file
    folder = load_file(f"{src}/model.safetensors")
    planned, bridged = _zeroed_rollout(src), _zeroed_rollout(src)
    first = sync.load_into(planned, model.chunks, model.bridge)
    first_bridge = sync.load_into(bridged, model.chunks, model.bridge, planned=False)
    named = _weights(planned)
    out = dict(first=first, first_bridge=first_bridge,
               planned_vs_bridge=_max_diff(named, _weights(bridged)),
               planned_vs_folder=_max_diff(named, {k: v for k, v in folder.items() if k in named}),
               hf_tensors=len(named))
    # a training step, then the same plan again (values changed, plan reused)
    opt = build_optimizer(model.chunks, OptimConfig(lr=1e-2), cfg)
    vocab_size = model.bridge.hf_pretrained.config.vocab_size
    batch = random_token_batches(steps=1, global_batch=2 * rt.world_size, seq_len_tokens=16, vocab_size=vocab_size, seed=9)[0]
    step(model.chunks, opt, batch, micro_batch_size=2)
    second = sync.load_into(planned, model.chunks, model.bridge)
    with _OpCount() as count:  # a warm replay: what every RL iteration pays
        sync.load_into(planned, model.chunks, model.bridge)
    out.update(replay_ops=dict(count.ops), units=len(sync_plan.cached(planned, model.chunks, model.bridge)[0].units))
    sync.load_into(bridged, model.chunks, model.bridge, planned=False)
    exported = dict(sync.export_hf_weights(model.chunks, model.bridge))
    named = _weights(planned)
    out.update(second=second, trained_planned_vs_bridge=_max_diff(named, _weights(bridged)),
               trained_planned_vs_export=_max_diff(named, {k: v for k, v in exported.items() if k in named}),
               changed_by_step=sum(not torch.equal(named[k], folder[k]) for k in named if k in folder))
    # a rollout tensor replaced (same name, new Parameter): the plan is rebuilt and writes the new one
    norm = planned.get_submodule("model.norm")
    norm.weight = torch.nn.Parameter(torch.zeros_like(norm.weight))
    out["replaced"] = sync.load_into(planned, model.chunks, model.bridge)
    out["replaced_vs_bridge"] = _max_diff(_weights(planned), _weights(bridged))
    if sabotage:  # a misunderstood mapping and an unknown one: both fall back, still exact
        table = sync_views.recognised()
        saved = _sabotaged()
        try:
            third = _zeroed_rollout(src)
            out["sabotaged"] = sync.load_into(third, model.chunks, model.bridge)
            out["sabotaged_vs_bridge"] = _max_diff(_weights(third), _weights(bridged))
        finally:
            table.clear()
            table.update(saved)
    out["layers"] = model.bridge.hf_pretrained.config.num_hidden_layers
    runtime.shutdown()
    return out
