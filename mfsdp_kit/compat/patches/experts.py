"""Megatron-Bridge 0.3.1 numbers experts for Transformer Engine's grouped GEMM only.

Without TE the experts are megatron's SequentialMLP: parameters named
`decoder.layers.<l>.mlp.experts.local_experts.<i>.linear_fc1.weight`, where <i> is the expert's
index *on this expert-parallel rank* (0 .. num_experts / EP - 1). The bridge knows only TE's names
(`mlp.experts.linear_fc1.weight<i>`), in two places:

1. `models/conversion/model_bridge.py:146-166` `_megatron_local_name_to_global` turns the local
   expert number into the global one for grouped names only. A SequentialMLP name keeps its local
   number, so at EP 2 the second rank loads HF experts 0..E/2-1 into its experts E/2..E-1 (wrong
   weights, no error) and exports them under the wrong names. Here the same arithmetic
   (global = E/EP * ep_rank + local) is applied to `local_experts.<i>`.
2. `models/conversion/param_mapping.py:674-677` `gather_from_ep_ranks` parses the expert number
   from the grouped-name suffix: `int(name.split(".weight")[-1])` is `int('')` for a SequentialMLP
   name (ValueError). Here each EP rank's global expert number is all-gathered with its tensor, so
   every gathered tensor is named by the expert it really is - also when the ranks' conversion
   tasks are not in the same local order (the bridge sorts names as strings: `local_experts.10`
   before `local_experts.2`). At EP 1 the gather is the identity.

Delete a half when `still_needed` says upstream handles SequentialMLP names there.
"""
from __future__ import annotations

import inspect
import re

from .. import registry

_LOCAL = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def _enable() -> None:
    _patch_global_names()
    _patch_gather()


def _patch_global_names() -> None:
    from megatron.bridge.models.conversion import model_bridge
    original = model_bridge._megatron_local_name_to_global
    if hasattr(original, "__wrapped__"):
        return

    def _megatron_local_name_to_global(models, config, param_name, vp_stage=None):
        return global_expert_name(original(models, config, param_name, vp_stage), config.num_moe_experts)

    _megatron_local_name_to_global.__wrapped__ = original
    model_bridge._megatron_local_name_to_global = _megatron_local_name_to_global
    registry.record(registry.Patch(
        target="megatron.bridge.models.conversion.model_bridge:_megatron_local_name_to_global",
        upstream="megatron/bridge/models/conversion/model_bridge.py:146-166 (only grouped-GEMM expert names "
                 "are numbered globally)", package="megatron-bridge", needed_if=global_names_still_needed))


def global_expert_name(name: str, num_experts: int | None) -> str:
    """`local_experts.<local>` -> `local_experts.<global>` on this expert-parallel rank (EP 1: unchanged)."""
    from megatron.core import parallel_state as ps
    match = _LOCAL.search(name)
    if match is None or not num_experts or ".adapter." in name:
        return name
    ep = ps.get_expert_model_parallel_world_size()
    if ep == 1:
        return name
    number = num_experts // ep * ps.get_expert_model_parallel_rank() + int(match.group(1))
    return name[:match.start(1)] + str(number) + name[match.end(1):]


def _patch_gather() -> None:
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping
    original = MegatronParamMapping.gather_from_ep_ranks
    if hasattr(original, "__wrapped__"):
        return

    def gather_from_ep_ranks(self, megatron_weights, megatron_module, hf_param_name):
        match = _LOCAL.search(self.megatron_param)
        if match is None:
            return original(self, megatron_weights, megatron_module, hf_param_name)
        if self.ep_size == 1:
            return {str(hf_param_name): megatron_weights}
        return _gather_named(megatron_weights, int(match.group(1)), str(hf_param_name), self.ep_group)

    gather_from_ep_ranks.__wrapped__ = original
    MegatronParamMapping.gather_from_ep_ranks = gather_from_ep_ranks
    registry.record(registry.Patch(
        target="megatron.bridge.models.conversion.param_mapping:MegatronParamMapping.gather_from_ep_ranks",
        upstream="megatron/bridge/models/conversion/param_mapping.py:674-677 (expert number parsed from the "
                 "grouped-GEMM name suffix)", package="megatron-bridge",
        needed_if="int(self.megatron_param.split(key)[-1])"))


def _gather_named(weights, expert: int, hf_name: str, group) -> dict:
    """{HF name of expert e: its tensor} for the expert every rank of `group` holds at this task."""
    import torch
    import torch.distributed as dist
    size = dist.get_world_size(group)
    numbers = [torch.zeros(1, dtype=torch.long, device=weights.device) for _ in range(size)]
    dist.all_gather(numbers, torch.tensor([expert], dtype=torch.long, device=weights.device), group=group)
    tensors = [torch.empty_like(weights) for _ in range(size)]
    dist.all_gather(tensors, weights.contiguous(), group=group)
    if not re.search(rf"experts\.{expert}\.", hf_name):
        raise ValueError(f"HF name {hf_name!r} does not hold expert {expert} of its Megatron parameter")
    return {re.sub(rf"experts\.{expert}\.", f"experts.{int(n)}.", hf_name): t for n, t in zip(numbers, tensors)}


def global_names_still_needed() -> bool:
    """True while upstream renumbers only grouped-GEMM expert names (`.mlp.experts.linear_fc`)."""
    from megatron.bridge.models.conversion import model_bridge
    fn = model_bridge._megatron_local_name_to_global
    return "local_experts" not in inspect.getsource(getattr(fn, "__wrapped__", fn))
