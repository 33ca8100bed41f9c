"""Profile scenarios (2 gloo ranks, fp32, spec tiny), run by launch.run."""
from __future__ import annotations

import torch.distributed as dist

from mfsdp_kit.models.gpt import SPECS
from mfsdp_kit.perf.profile import exposed_intervals, profile_mode, step_breakdown


def three_systems() -> dict:
    """ddp, fsdp and fsdp2 each profiled for 2 steps: per mode, every rank's kinds and calls per
    step, its breakdown, and the exposed time of step 1."""
    out = {}
    for mode in ("ddp", "fsdp", "fsdp2"):
        events, spans = profile_mode(mode, SPECS["tiny"], dtype="fp32", micro_batch_size=2, steps=2)
        mine = dict(kinds=sorted({e.kind for e in events}), lanes=sorted({e.lane for e in events}),
                    steps=len(spans), breakdown=step_breakdown(events, spans),
                    exposed_s=sum(e - s for s, e in exposed_intervals([e for e in events if e.step == 1])),
                    in_span=all(0 <= e.start_s <= e.end_s <= spans[e.step][1] - spans[e.step][0] + 1e-9
                                for e in events))
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        out[mode] = ranks
    return out
