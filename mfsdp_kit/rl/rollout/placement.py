"""Where a rollout backend's prompts go and how its samples come back: the backend's, not the RL loop's.

`ReplicaPlacement` is the placement of a backend that holds a whole model on every rank (HFRollout,
ContinuousRollout): each data-parallel replica samples its slice of the prompts, every rank of a replica (its
tensor-parallel ranks) samples the same rows with the same seed, and the slices come back over the
data-parallel group, which holds exactly one rank of each replica whatever the tensor or pipeline layout. A
backend that serves the whole batch from one engine (a server, say) would set `placement` to its own object
with the same three verbs.
"""
from __future__ import annotations

import torch.distributed as dist

from ...config import bad_value


class ReplicaPlacement:
    """Prompts split by data-parallel replica; samples all-gathered over the data-parallel group."""

    def replica(self) -> int:
        """This rank's replica: its data-parallel rank (added to the sampling seed)."""
        from megatron.core import parallel_state as ps
        return ps.get_data_parallel_rank()

    def share(self, prompts: list) -> list:
        """This replica's consecutive slice of `prompts` (the same list on every rank)."""
        from megatron.core import parallel_state as ps
        dp = ps.get_data_parallel_world_size()
        if len(prompts) % dp:
            raise bad_value("prompts_per_iteration", len(prompts), f"a multiple of the data-parallel size {dp}")
        r = self.replica()
        return prompts[r * len(prompts) // dp:(r + 1) * len(prompts) // dp]

    def gather(self, local) -> list:
        """Every replica's `local` (any picklable value), in replica order, on every rank."""
        from megatron.core import parallel_state as ps
        group = ps.get_data_parallel_group()
        parts = [None] * dist.get_world_size(group=group)
        dist.all_gather_object(parts, local, group=group)
        return parts
