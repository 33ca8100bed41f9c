"""What every rollout backend shares: the interface `rl.core.collect` samples through, what `sample` returns, and the
refresh of an HF model on this rank from the training chunks. `hf.HFRollout` and `engine.ContinuousRollout` each hold
their model and use these; neither is built on the other.

A backend needs two verbs and a tokenizer (`RolloutBackend`), so a vLLM or SGLang engine (or a Megatron-native
sampler) drops in by implementing them:

    refresh(chunks, bridge) -> stats        copy the training weights in (every chunk, every rank)
    sample(prompts, n=, ...) -> Completions n completions per prompt, prompt-major order, with the
                                            sampled tokens' log-probs (None if it does not score them)

`refresh` = `engine.synchronize_fsdp_params` (sharded view: wait for in-flight all-gathers, show the optimized DTensor
shards) -> `sync.load_into` (export every HF tensor, copy it in) -> `engine.restore_fsdp_params` (compute view, ready
for the next forward). The two engine halves, not `engine.params_view(chunks, "sharded")`: that context manager puts
back the view each chunk showed before, which right after `engine.build_optimizer` is the sharded one; the rollout
path has always left the compute view installed (and `offload.offload` records the chunks that showed it, to put it
back at `reload`), so the halves keep the behaviour exactly.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from ...distributed import engine
from ...weights import sync


class Completions(list):
    """What `RolloutBackend.sample` returns: a list of completions (token ids, cut after the first stop id) and
    `logprobs`, each sampled token's log-prob at the sampling temperature (None if the backend does not score);
    with tools, `model_mask` per completion (1: a token the model sampled, 0: a tool's) and log-probs of the
    model's tokens only (None: every token is the model's)."""

    def __init__(self, tokens=(), *, logprobs: list[list[float]] | None = None,
                 model_mask: list[list[int]] | None = None, routes: list | None = None):
        super().__init__(tokens)
        self.logprobs, self.model_mask = logprobs, model_mask
        self.routes = routes
        """With `sample(..., routes=True)` (the kit's engine on an MoE model): per completion, the experts each MoE
        layer chose for its prompt's and completion's tokens, [tokens, moe_layers, k] int16 (`routes.py`)."""


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


def refresh(hf_model, chunks, bridge) -> dict:
    """Copy the current training weights of every chunk into `hf_model` in place (module docstring); returns
    `sync.load_into`'s {"seconds", "bytes", "tensors", ...}."""
    engine.synchronize_fsdp_params(chunks)
    try:
        return sync.load_into(hf_model, chunks, bridge)
    finally:
        engine.restore_fsdp_params(chunks)
