"""What the model runner's launches are told, in two objects (nano-vllm's `Config.hf_config` and `utils/context.py`):

  - `ModelConstants`: what the decoder needs of the model beyond its weights (head size, OLMoE's q/k/v clamp, each
    layer's sliding window) and the cache's per-row arithmetic (layers, KV heads), read once from the HF config when
    the runner is made;
  - `Context`: one prefill's or extend's tensors on the device (the cache rows it writes, its tokens, the slot each
    row's tokens start at), made per launch from the scheduler's sequences.

A decode step has no `Context`: its inputs are the cache's static next-token and position buffers (`kv_cache.Cache`),
which a CUDA graph reads in place, and the scheduler's `Chunk` says which graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .decoder import layer_windows


@dataclass(frozen=True, kw_only=True)
class ModelConstants:
    """The model's constants for the rollout's launches, set once (`of`)."""

    head_dim: int
    """Channels of one attention head (the config's `head_dim`, else hidden_size / heads)."""
    clip_qkv: float | None
    """OLMoE's clamp of q, k and v (None: no clamp)."""
    windows: list[int | None]
    """Per layer, the sliding window it attends with, or None for full attention (`decoder.layer_windows`)."""
    layers: int
    """Decoder layers: a K and a V tensor each in the cache."""
    kv_heads: int
    """Key/value heads per layer."""
    hidden_size: int
    """The residual stream's width (the final hidden state a decode step returns)."""

    @classmethod
    def of(cls, hf_model) -> ModelConstants:
        c = hf_model.config
        return cls(head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                   clip_qkv=getattr(c, "clip_qkv", None), windows=layer_windows(hf_model),
                   layers=len(hf_model.model.layers), kv_heads=c.num_key_value_heads, hidden_size=c.hidden_size)

    def decoder_kwargs(self) -> dict:
        """What `decoder.prefill`, `extend` and `decode` take of the model as keywords."""
        return dict(head_dim=self.head_dim, clip_qkv=self.clip_qkv, windows=self.windows)


@dataclass(frozen=True, kw_only=True)
class Context:
    """One prefill or extend launch: `ids` [k, L] written into cache rows `rows` [k] from slot `starts` [k] on (None:
    slot 0, a prefill of prompts), `lengths` [k] real tokens each (the rest of a row is padding that is not written)."""

    rows: torch.Tensor
    ids: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor | None = None

    @classmethod
    def of(cls, *, rows: list[int], tokens: list[list[int]], starts: list[int] | None = None, device) -> Context:
        """The launch's tensors on `device` from the host's lists (`tokens` padded by `padded`)."""
        return cls(rows=torch.tensor(rows, device=device), ids=padded(tokens).to(device),
                   lengths=torch.tensor([len(t) for t in tokens], device=device),
                   starts=None if starts is None else torch.tensor(starts, device=device))

    def placed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each token's cache row and slot and whether it is real ([k, L] each), in `ids`' layout."""
        k, L = self.ids.shape
        offsets = torch.arange(L, device=self.ids.device)
        starts = torch.zeros_like(self.lengths) if self.starts is None else self.starts
        return (self.rows[:, None].expand(k, L), starts[:, None] + offsets[None],
                offsets[None] < self.lengths[:, None])

    @property
    def ends(self) -> torch.Tensor:
        """[k] the slot after each row's last token: its next token's position."""
        return self.lengths if self.starts is None else self.starts + self.lengths


def padded(rows: list[list[int]]) -> torch.Tensor:
    """Token rows left-aligned in one [len(rows), longest] tensor, zeros after each row."""
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for j, row in enumerate(rows):
        ids[j, :len(row)] = torch.tensor(row)
    return ids
