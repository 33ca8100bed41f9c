"""The experts each MoE layer chose for every token the engine forwards, kept per cache row and slot like K and V:
what the trainer replays (`models.router_replay`, `RolloutConfig.router_replay`).

A forward hook on each MoE block's router (`mlp.gate`, the linear layer whose logits the HF block softmaxes and
takes the top-k of) computes the same top-k from the same logits and writes it into a table [moe_layers, rows,
slots, k] int16 at the cache row and slot of each token: the runner says where the next forward's tokens sit
(`expect`: a prefill's rows and slots 0..L-1, an extend's slots from its start, a decode step's row positions, read
at the hook, so a chunk of steps needs one call). Rows are copied with their K/V (`move`: a compaction, or a shared
prefill's copies of a prompt); a finished sequence's routes are copied out before its row is reused (`take`). The
sampled token that ends a sequence is never fed, so its route is whatever the slot held: its output is no log-prob
the trainer keeps.

MoE layers run eagerly (no CUDA graphs: `ModelRunner.graphs`), so the hooks run at every step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...models.router_replay import ROUTE_DTYPE


def routers(model) -> list[tuple[torch.nn.Module, int]]:
    """(router linear, k) of each MoE layer of an HF causal LM, in layer order; empty for a dense model."""
    out = []
    for layer in model.model.layers:
        gate, k = getattr(layer.mlp, "gate", None), getattr(layer.mlp, "top_k", None)
        if isinstance(gate, torch.nn.Linear) and k:
            out.append((gate, int(k)))
    return out


class RouteTable:
    """The recorded routes of one cache shape and the hooks that write them (module docstring)."""

    def __init__(self, model, *, rows: int, slots: int, device):
        found = routers(model)
        if not found:
            raise ValueError(f"routes: {type(model).__name__} has no MoE layers to record")
        self.k = found[0][1]
        self.table = torch.zeros(len(found), rows, slots, self.k, dtype=ROUTE_DTYPE, device=device)
        self.where: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self.hooks = [gate.register_forward_hook(self._writer(j)) for j, (gate, _) in enumerate(found)]

    def _writer(self, layer: int):
        def write(module, args, logits):
            if self.where is None:   # a forward nobody placed (the sizer's probe): nothing to keep
                return
            rows, slots, keep = self.where
            idx = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float), self.k, dim=-1).indices
            rows, slots = rows.reshape(-1), slots.reshape(-1)
            if keep is not None:
                keep = keep.reshape(-1)
                idx, rows, slots = idx[keep], rows[keep], slots[keep]
            self.table[layer, rows, slots] = idx.to(ROUTE_DTYPE)
        return write

    def expect(self, rows: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """The next forwards' tokens, in the order the model flattens them ([batch, tokens] row-major): each one's
        cache row and slot, and which to keep (None: all)."""
        self.where = (rows, slots, keep)

    def move(self, src: torch.Tensor, dst: torch.Tensor, slots: int) -> None:
        """Rows `src` copied to rows `dst`, their first `slots` slots (as `ModelRunner.copy_rows` copies K/V)."""
        self.table[:, dst, :slots] = self.table[:, src, :slots]

    def take(self, row: int, tokens: int) -> torch.Tensor:
        """[tokens, moe_layers, k] of cache row `row`'s first `tokens` slots: a copy on the host (off a GPU `.cpu()`
        would be a view of a row the next sequence overwrites)."""
        return self.table[:, row, :tokens].permute(1, 0, 2).to("cpu", copy=True)

    def close(self) -> None:
        """Remove the hooks (the table goes with this object)."""
        for h in self.hooks:
            h.remove()
        self.hooks, self.where = [], None
