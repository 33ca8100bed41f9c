"""Rollout backends: what samples completions from the policy's current weights.

A backend needs two verbs and a tokenizer (`RolloutBackend`, in `backend.py` with `Completions` and the weights'
`refresh` every backend shares); `rl.core.collect` uses nothing else, so a vLLM or SGLang engine (or a Megatron-native
sampler) drops in by implementing them.

`hf.HFRollout`: a `transformers` model on each rank, refreshed in place, sampled by `generate`: any causal LM,
the reference.
`engine.ContinuousRollout`: the same model and refresh, sampled by the kit's own engine (continuous batching over a
slot KV cache sized from free memory, a CUDA graph per batch and slot bucket on a GPU, `decoder.py`'s fused
projections): Llama, Mistral, Qwen2/3 and their MoE kin; docs/benchmarks.md, "rollout". Its three roles:
`scheduler.Scheduler` (host), `model_runner.ModelRunner` (device; `kv_cache.py`, `context.py`) and the engine's `step`
joining them; its kernels are in `kernels/`. `default_backend` picks it where it runs, HFRollout elsewhere.
`tools`: `Tool`s a row may call mid-completion (a calculator, `tools.calculator`); the engine pauses the row,
prefills the tool's output into its own KV cache and resumes (`scheduler.py`, `model_runner.py`); HFRollout refuses
them.
"""
from __future__ import annotations

from ...config import ConfigError
from .backend import Completions, RolloutBackend
from .decoder import SUPPORTED
from .engine import ContinuousRollout, DecodeConfig
from .hf import HFRollout
from .tools import CALCULATOR, Tool, ToolConfig, ToolError, calculator


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
