"""Rollout backends: what samples completions from the policy's current weights.

A backend needs two verbs and a tokenizer; `rl.core.collect` uses nothing else, so a vLLM or
SGLang engine (or a Megatron-native sampler) drops in by implementing `RolloutBackend`:

    refresh(chunks, bridge) -> stats        copy the training weights in (every chunk, every rank)
    sample(prompts, n=, ...) -> token ids   n completions per prompt, prompt-major order

`hf.HFRollout`: a `transformers` model on each rank, refreshed in place, sampled by `generate`.
`static.StaticCacheRollout`: the same model and refresh, sampled by the kit's own decode loop (a
preallocated KV cache, a CUDA graph per batch on a GPU): 7-18x `generate` on 1 H200
(docs/benchmarks.md, "rollout"); Llama, Mistral, Qwen2/3 and their MoE kin only.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from .hf import HFRollout
from .static import StaticCacheRollout


@runtime_checkable
class RolloutBackend(Protocol):
    """The interface `rl.core.collect` samples through."""

    tokenizer: object
    """An HF tokenizer: encodes the prompts (for the training batch), decodes completions (for the
    reward), gives `pad_token_id` / `eos_token_id`. Must be the training model's tokenizer."""

    def refresh(self, chunks, bridge) -> dict:
        """Copy the current weights of every training chunk in; returns at least {"bytes": int,
        "tensors": int}. Called on every rank (the export runs collectives)."""
        ...

    def sample(self, prompts: list[str], *, n: int, max_new_tokens: int, temperature: float, top_p: float,
               seed: int) -> list[list[int]]:
        """n completions (token ids, cut after eos) per prompt, prompt-major: completion i belongs
        to prompt i // n. Same `seed` and weights -> same samples (TP ranks of one replica rely on it)."""
        ...


__all__ = ["HFRollout", "RolloutBackend", "StaticCacheRollout"]
