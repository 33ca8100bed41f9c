"""The rank arithmetic, in one object (torchtitan's `ParallelDims`): how `world` ranks split into data-parallel
replicas and shards, tensor, context, expert and pipeline ranks, checked once when it is made.

    world = dp_replicate x dp_shard x tp x pp          dp_shard counts the context-parallel ranks of a replica:
    dp    = world / (tp x pp x cp)                     Megatron-FSDP shards over the data x context group (dp_cp),
    dp_cp = dp x cp = dp_replicate x dp_shard          megatron's HSDP cuts that group into dp_replicate instances

For example 16 GPUs on 2 nodes, TP 2, HSDP across the nodes: dp = 16 / 2 = 8, dp_replicate = 2, dp_shard = 4, so
weights are sharded over the 4 data-parallel ranks of a node and each grad shard is all-reduced across 2 nodes.
Experts (EP) are carved out of a pipeline stage's tp x cp x dp ranks; their weights are data-parallel over
expert_dp = world / (pp x tp x ep) ranks (expert TP = TP, megatron's default).

`EngineConfig.validate(world_size=)` makes one, so every layout mistake is a `ConfigError` naming the field
(`parallelism.<name>`), its value and what would be allowed, before any process group exists.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..fieldtypes import bad_value

REPLICATE = "parallelism.data_parallel_replicate_size"
SHARD = "parallelism.data_parallel_shard_size"
FIELDS = dict(world="world_size", dp_replicate=REPLICATE, tp="parallelism.tensor_model_parallel_size",
              cp="parallelism.context_parallel_size", ep="parallelism.expert_model_parallel_size",
              pp="parallelism.pipeline_model_parallel_size")
"""ParallelDims' sizes by the name the user set them under (`check_sizes`)."""


def check_sizes(sizes: dict, *, shard) -> None:
    """Each of `sizes` (name -> value) a positive integer and `shard` (the data-parallel shard size) -1 or one:
    before anything divides by them. `EngineConfig` calls it before the world size is known, `ParallelDims` again."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad_value(name, value, "a positive integer")
    if isinstance(shard, bool) or not isinstance(shard, int) or shard == 0 or shard < -1:
        raise bad_value(SHARD, shard, "-1 (what the world leaves) or a positive integer")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Sizes of every parallel dimension of one world; made only valid (`ConfigError` otherwise)."""

    world: int
    """Ranks in the world."""
    dp_replicate: int = 1
    """HSDP instances: replicas of the sharded state (1 = no HSDP)."""
    dp_shard: int = -1
    """Ranks one replica shards over (data x context); -1 = what the world leaves (filled when made)."""
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1

    def __post_init__(self):
        check_sizes({name: getattr(self, attr) for attr, name in FIELDS.items()}, shard=self.dp_shard)
        tp, pp, cp, ep, k = self.tp, self.pp, self.cp, self.ep, self.dp_replicate
        if self.world % self.model_parallel:
            raise bad_value("world_size", self.world, f"a multiple of tensor*pipeline*context parallel sizes = "
                            f"{tp}*{pp}*{cp} = {self.model_parallel}")
        per_stage = tp * cp * self.dp   # megatron carves EP groups out of a pipeline stage's ranks
        if ep > 1 and per_stage % (tp * ep):   # parallel_state.initialize_model_parallel: world % (etp*ep*pp)
            raise bad_value("parallelism.expert_model_parallel_size", ep,
                            f"a size with tensor_model_parallel_size * expert_model_parallel_size dividing the "
                            f"{per_stage} tensor*context*data-parallel ranks of a pipeline stage (world_size="
                            f"{self.world})")
        if self.dp_cp % k:
            raise bad_value(REPLICATE, k, f"a divisor of the {self.dp_cp} data x context-parallel ranks (world_size="
                            f"{self.world}; parallel_state.py:833): each instance holds the same number of ranks")
        if ep > 1 and self.expert_dp % k:
            raise bad_value(REPLICATE, k, f"a divisor of the experts' {self.expert_dp} data-parallel ranks "
                            "(parallel_state.py:1264)")
        shard = self.dp_cp // k
        if self.dp_shard not in (-1, shard):
            raise bad_value(SHARD, self.dp_shard, f"-1 or {shard}: world_size={self.world} / (tensor {tp} * "
                            f"pipeline {pp} * data_parallel_replicate_size {k})")
        object.__setattr__(self, "dp_shard", shard)

    @classmethod
    def of(cls, parallelism, *, world_size: int) -> "ParallelDims":
        """The dims of an `EngineConfig.parallelism` section over `world_size` ranks."""
        p = parallelism
        return cls(world=world_size, dp_replicate=p.data_parallel_replicate_size, dp_shard=p.data_parallel_shard_size,
                   tp=p.tensor_model_parallel_size, cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
                   pp=p.pipeline_model_parallel_size)

    @property
    def model_parallel(self) -> int:
        """tp x pp x cp: the ranks that hold one copy of the model between them."""
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel ranks (megatron's data-parallel size, without context parallelism)."""
        return self.world // self.model_parallel

    @property
    def dp_cp(self) -> int:
        """Data x context-parallel ranks: what Megatron-FSDP and the distributed optimizer shard over (all replicas)."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Data-parallel ranks of the expert weights: world / (pp x tp x ep), expert TP = TP."""
        return self.world // (self.pp * self.tp * self.ep)

    @property
    def hsdp(self) -> bool:
        """Whether the sharded state is replicated (HSDP)."""
        return self.dp_replicate > 1
