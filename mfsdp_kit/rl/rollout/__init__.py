"""Rollout backends: what samples completions from the policy's current weights.

A backend needs two verbs and a tokenizer; `rl.core.collect` uses nothing else, so a vLLM or
SGLang engine (or a Megatron-native sampler) drops in by implementing `RolloutBackend`:

    refresh(chunks, bridge) -> stats        copy the training weights in (every chunk, every rank)
    sample(prompts, n=, ...) -> Completions n completions per prompt, prompt-major order, with the
                                            sampled tokens' log-probs (None if it does not score them)

`hf.HFRollout`: a `transformers` model on each rank, refreshed in place, sampled by `generate`: any causal LM,
the reference.
`continuous.ContinuousRollout`: the same model and refresh, sampled by the kit's own engine (continuous
batching over a slot KV cache sized from free memory, a CUDA graph per batch and slot bucket on a GPU,
`decoder.py`'s fused projections): Llama, Mistral, Qwen2/3 and their MoE kin; docs/benchmarks.md, "rollout".
`default_backend` picks it where it runs, HFRollout elsewhere.
`tools`: `Tool`s a row may call mid-completion (a calculator, `tools.calculator`); the engine pauses the row,
prefills the tool's output into its own KV cache and resumes (`scheduler.py`, `run.py`); HFRollout refuses them.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from ...config import ConfigError
from .continuous import ContinuousRollout, DecodeConfig
from .decoder import SUPPORTED
from .hf import Completions, HFRollout
from .tools import CALCULATOR, Tool, ToolConfig, ToolError, calculator


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
               seed: int) -> Completions:
        """n completions (token ids, cut after the first stop id) per prompt, prompt-major: completion i belongs
        to prompt i // n, with `.logprobs` (log softmax(logits / temperature) of each sampled token, or None).
        Same `seed` and weights -> same samples (TP ranks of one replica rely on it)."""
        ...


def default_backend(hf_model, tokenizer, *, config: DecodeConfig | None = None, tools: ToolConfig | None = None):
    """`ContinuousRollout` for the architectures it runs (`decoder.SUPPORTED`), on a GPU or a CPU alike;
    `HFRollout` (transformers' `generate`, the reference) for any other causal LM, which runs no `tools`."""
    if type(hf_model).__name__ in SUPPORTED:
        return ContinuousRollout(hf_model, tokenizer, config=config, tools=tools)
    if tools is not None and tools.tools:
        raise ConfigError(f"tools: only the kit's engine runs tool calls (architectures {', '.join(SUPPORTED)}), "
                          f"not HFRollout's generate for {type(hf_model).__name__}; pass tools=None")
    return HFRollout(hf_model, tokenizer)


__all__ = ["default_backend", "CALCULATOR", "calculator", "Completions", "ContinuousRollout", "DecodeConfig",
           "HFRollout", "RolloutBackend", "Tool", "ToolConfig", "ToolError"]
