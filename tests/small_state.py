"""The smallest torch DCP `Stateful` for the checkpoint tests: saves in this process, no process group."""
from __future__ import annotations

import torch


class Small:
    """One tensor of `size` elements, all `value`."""

    def __init__(self, value: float = 1.0, *, size: int = 4):
        self.w = torch.full((size,), value)

    def state_dict(self):
        return {"w": self.w}

    def load_state_dict(self, state_dict):
        self.w.copy_(state_dict["w"])
