"""HSDP: Megatron-FSDP sharded within an instance, replicated across instances.

`override_ddp_config={"num_distributed_optimizer_instances": k}` splits the D data-parallel ranks into k
instances of D/k ranks. Megatron-FSDP then shards weights, grads and optimizer state over the D/k ranks of an
instance (a node's GPUs, on NVLink) and all-reduces each instance's grad shard across the k instances once per
step: the per-layer all-gathers and reduce-scatters stay inside the node, and the slower network between nodes
carries one all-reduce of 1/(D/k) of the grads per rank. Memory per rank is ZeRO-3's over D/k ranks, not D.

`runtime.init` builds megatron's groups for it (`initialize_model_parallel(num_distributed_optimizer_instances=)`).
What megatron-core 0.16.1 gets right here is shown on 4 gloo ranks (2 instances x 2, tests/test_hsdp.py: losses
and grad norms equal DDP's and Megatron-FSDP's, checkpoint round trip bitwise, exact resume, exact weight sync
and export); what it gets wrong is refused, each with the reason: by `validate` before any process group exists,
or by `check_model` when the wrap meets a model whose MoE experts come from its own config (an HF folder).
"""
from __future__ import annotations

from typing import Any

from .fieldtypes import bad_value

FIELD = "num_distributed_optimizer_instances"
NAME = f"override_ddp_config.{FIELD}"


def instances(cfg: Any) -> int:
    """k: the number of replicas of the sharded state (1 = plain Megatron-FSDP / distributed optimizer)."""
    return cfg.override_ddp_config.get(FIELD, 1)


def validate(cfg: Any, *, world_size: int | None, on_gpu: bool) -> None:
    """`EngineConfig.validate`'s HSDP part: what megatron-core 0.16.1 would get wrong, or fail on later."""
    k = instances(cfg)
    if k == 1:
        return
    outer = cfg.override_ddp_config.get("outer_dp_sharding_strategy", "no_shard")
    if outer != "no_shard":
        raise bad_value("override_ddp_config.outer_dp_sharding_strategy", outer,
                        "'no_shard' with HSDP: megatron-core 0.16.1 sums the grad norm inside one instance "
                        "(optimizer/__init__.py:456-459, 'each instance has the duplicated weight gradients'), which "
                        "sharding across instances makes false: the norm was 0.82 against DDP's 1.32 on the same "
                        "step (4 gloo ranks), and clipping follows it")
    if cfg.use_megatron_fsdp and (cfg.expert_model_parallel_size > 1 or cfg.override_transformer_config.get(
            "num_moe_experts")):
        raise bad_value(NAME, k, _NO_EXPERTS)
    if not cfg.use_megatron_fsdp and not cfg.use_distributed_optimizer:
        raise bad_value(NAME, k, "1 without use_distributed_optimizer (megatron: 'Partial DistOpt cannot be used "
                        "without DistOpt')")
    if not cfg.use_megatron_fsdp and not on_gpu:
        raise bad_value(NAME, k, "1 for DDP without a GPU: megatron's DDP all-reduces across instances on a CUDA "
                        "stream (distributed/distributed_data_parallel.py:230); Megatron-FSDP's HSDP runs on CPU")
    if world_size is None or world_size % cfg.model_parallel_size:
        return
    dp_cp = cfg.data_parallel_size(world_size) * cfg.context_parallel_size   # instances cut the data x context group
    if dp_cp % k:
        raise bad_value(NAME, k, f"a divisor of the {dp_cp} data x context-parallel ranks (world_size={world_size}; "
                        "parallel_state.py:833): each instance holds the same number of ranks")
    experts_dp = world_size // (cfg.pipeline_model_parallel_size * cfg.tensor_model_parallel_size
                                * cfg.expert_model_parallel_size)   # DDP's experts (expert TP = TP)
    if cfg.expert_model_parallel_size > 1 and experts_dp % k:
        raise bad_value(NAME, k, f"a divisor of the experts' {experts_dp} data-parallel ranks (parallel_state.py:1264)")


_NO_EXPERTS = ("1 with MoE experts under Megatron-FSDP: megatron-core 0.16.1's HSDP branch builds no expert mesh "
               "(distributed/fsdp/mcore_fsdp_adapter.py:203-214), and an EP 2 model's grad norm differed from "
               "Megatron-FSDP's by 7e-4 at step 1 (fp32, 4 gloo ranks, where dense models agree to 3e-7)")


def sharded_across(fsdp: Any) -> bool:
    """Whether a Megatron-FSDP module shards across HSDP instances too (an outer strategy `validate` refuses)."""
    return fsdp.dist_index.use_hybrid_fsdp and fsdp.ddp_config.outer_dp_sharding_strategy != "no_shard"


def check_model(cfg: Any, model_config: Any) -> None:
    """At wrap time: an HF folder's MoE model under HSDP (its experts are known only from its config)."""
    if cfg.use_megatron_fsdp and instances(cfg) > 1 and getattr(model_config, "num_moe_experts", None):
        raise bad_value(NAME, instances(cfg), _NO_EXPERTS)
