"""PPO's value model: the policy's architecture with a scalar head, sharded by Megatron-FSDP like the policy, with
its own optimizer; its forward, its clipped loss and its update.

The naive critic is a second network class with a `value_head` and a training loop of its own. Here it is the
kit's own model chunks, built the way the policy is (`engine.build(cfg, model_fn, wrap=False)`, or
`models.hf.load(path, cfg, wrap=False).chunks` to start from the policy's weights), with two changes made before
the data-parallel wrap (`value_model`):

1. the LM output layer (hidden -> vocab) is replaced by `ValueHead` (hidden -> 1, zero at first: V = 0);
2. the chunk's per-token loss becomes its per-token value. megatron's `GPTModel._postprocess` ends with
   `loss = self.compute_language_model_loss(labels, logits)` whenever labels are given (compat/patches/
   value_loss.py cites the lines); its `_values_as_loss` in that method's place returns the head's output [b, s].

So everything the kit runs on per-token losses runs the critic unchanged: `train.step` / `run_steps` hand the values
to the loss_fn as `token_losses` (`value_loss`), packed rows come back in the padded layout (`packing`), and
`core.token_logprobs`, which returns minus the per-token loss, gives minus the values (`values`). Then
`engine.wrap_chunks` shards it (Megatron-FSDP `optim_grads_params`, as `cfg` says) and `engine.build_optimizer`
gives it its own distributed optimizer: nothing is shared with the policy but the process groups.

The value at position t is V(tokens[:t+1]): in `core.rollout_batch`'s layout, position t's label is the token
sampled there, so V_t is the value of the state in which that token was chosen, read at the same loss positions as
the policy's log-probs (`advantages.gae`).

Clipped value loss (PPO's, as in verl and OpenAI's baselines), per completion token, with V_old the values the
advantages were computed from and R the returns:

    V_clip = V_old + clip(V - V_old, -value_clip, +value_clip)
    l      = 0.5 * max((V - R)^2, (V_clip - R)^2)

averaged over the minibatch's completion tokens (megatron's per-token loss). Tensor parallelism is refused: the
scalar head is not split over tensor-parallel ranks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from .. import compat
from ..distributed import engine
from ..config import bad_value
from ..train import Batch
from ..train.options import StepOptions, takes_options
from . import core
from .core import RolloutBatch


@dataclass(kw_only=True)
class Critic:
    """A value model and its own training state: what PPO's advantage estimator reads and trains
    (`rl.algorithms.ppo`; `loop.Models.critic`)."""

    chunks: list
    """The value model (`value_model`)."""
    optimizer: Any
    """Its optimizer, apart from the policy's (`engine.build_optimizer(chunks, ocfg, cfg)`)."""
    scheduler: Any = None
    """Steps once per critic optimizer step (None: none)."""


class ValueHead(torch.nn.Module):
    """hidden [s, b, h] -> values [s, b, 1], in the output layer's call convention (`weight`, the tied embedding,
    and `runtime_gather_output` are ignored; the result is `(output, bias)` with the bias already added)."""

    def __init__(self, hidden_size: int, *, dtype: torch.dtype, device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def attach_value_head(chunk: torch.nn.Module) -> None:
    """Give one unwrapped chunk (a megatron GPTModel, possibly inside Float16Module) a `ValueHead` and values as its
    per-token output. Chunks without the output layer (not the last pipeline stage) are left alone."""
    from megatron.core import tensor_parallel
    model = engine.unwrap_model(chunk)
    if not getattr(model, "post_process", False):
        return
    if getattr(model.config, "mtp_num_layers", None):
        raise bad_value("mtp_num_layers", model.config.mtp_num_layers, "None for a value model (its multi-token "
                        "prediction losses would read the scalar head as logits)")
    old = model.output_layer.weight if model.output_layer.weight is not None else model.embedding.word_embeddings.weight
    model.output_layer = ValueHead(model.config.hidden_size, dtype=old.dtype, device=old.device)
    for p in model.output_layer.parameters():   # as engine.build does for every parameter
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    compat.apply("critic_values", model=model)   # values as its per-token output (compat/patches/value_loss.py)


def value_model(chunks: list[torch.nn.Module], cfg) -> list[torch.nn.Module]:
    """The critic from unwrapped `chunks` (`engine.build(cfg, model_fn, wrap=False)`, or
    `models.hf.load(path, cfg, wrap=False).chunks`): scalar heads attached, then wrapped (DDP or Megatron-FSDP) as
    `cfg` says. Give it its own optimizer: `engine.build_optimizer(critic, ocfg, cfg)`."""
    tp = cfg.parallelism.tensor_model_parallel_size
    if tp != 1:
        raise bad_value("tensor_model_parallel_size", tp, "1 for a value model (its scalar head is not split over "
                        "tensor-parallel ranks)")
    for chunk in chunks:
        attach_value_head(chunk)
    return engine.wrap_chunks(cfg, chunks)


def value_batch(rollouts: RolloutBatch, *, seq_len_tokens: int, pad_id: int) -> Batch:
    """The rollouts in `core.rollout_batch`'s layout (tokens, labels, completion-token mask), no extras yet."""
    n = rollouts.group_size
    b = core.rollout_batch([rollouts.prompt_ids[i // n] for i in range(len(rollouts.completions))],
                           rollouts.completions, torch.zeros(len(rollouts.completions)), seq_len_tokens=seq_len_tokens,
                           pad_id=pad_id, model_mask=rollouts.model_mask)
    return Batch(b.tokens, b.labels, b.loss_mask, {})


@takes_options
def values(chunks, batch: Batch, *, options: StepOptions) -> torch.Tensor:
    """V [n, seq] of the whole batch on every rank, 0 outside its loss mask: no grad, packed or padded as `options`
    (`train.StepOptions`, or its fields as keywords) say to `core.token_logprobs` (which returns minus the chunks'
    per-token output, here the values)."""
    return -core.token_logprobs(chunks, batch, options=options) * (batch.loss_mask != 0)


def value_loss(mb: Batch, token_losses: torch.Tensor, *, value_clip: float | None):
    """megatron loss_func of the clipped value loss (module docstring); `token_losses` are the critic's values V
    [b, s] (with grad), `mb.extras` holds "values" (V_old) and "returns". Logs value_clip_frac (share of tokens
    whose V left the clip range) per token."""
    mask = mb.loss_mask.float()
    v, old, ret = token_losses.float(), mb.extras["values"].float(), mb.extras["returns"].float()
    err = (v - ret) ** 2
    if value_clip is not None:
        clipped = old + (v - old).clamp(-value_clip, value_clip)
        err = torch.maximum(err, (clipped - ret) ** 2)
        outside = ((v - old).abs() > value_clip).float()
    else:
        outside = torch.zeros_like(v)
    loss_sum, tokens = (0.5 * err * mask).sum(), mask.sum()
    logged = {"lm loss": torch.stack([loss_sum.detach(), tokens]),
              "value_clip_frac": torch.stack([(outside.detach() * mask).sum(), tokens])}
    return loss_sum, tokens.to(torch.int), logged


def explained_variance(values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the completion tokens: 1 = the critic predicts the returns, 0 = no better than
    their mean, < 0 = worse; NaN when the returns do not vary."""
    on = loss_mask != 0
    r, v = returns.float()[on], values.float()[on]
    var = r.var(unbiased=False)
    return float("nan") if on.sum() == 0 or var == 0 else (1 - (r - v).var(unbiased=False) / var).item()


@takes_options
def update(*, chunks, optimizer, batch: Batch, value_clip: float | None, epochs: int, num_minibatches: int,
           options: StepOptions) -> dict:
    """The critic's `epochs` x `num_minibatches` optimizer steps on `batch` (extras "values" and "returns") with
    `value_loss` in place of `options`' loss_fn (`core.update`; `options`: its micro-batches and scheduler, or their
    fields as keywords). Returns value_loss (mean over the steps), value_clip_frac (mean), critic_update_s."""
    t0 = time.perf_counter()
    results = core.update(chunks=chunks, optimizer=optimizer, batch=batch, epochs=epochs,
                          num_minibatches=num_minibatches,
                          options=replace(options, loss_fn=partial(value_loss, value_clip=value_clip)))
    return dict(value_loss=sum(r.loss for r in results) / len(results),
                value_clip_frac=sum(r.metrics["value_clip_frac"] for r in results) / len(results),
                critic_update_s=time.perf_counter() - t0)
