"""Log-probs at the sampling temperature, and how far the trainer's are from the rollout engine's.

A sampler draws from softmax(logits / T). verl scores the sampled tokens the same way on the trainer side
(logits / T for the old, reference and current policy), so the PPO ratio compares the distribution the
tokens came from, and the rollout's own log-probs can be checked against the trainer's token for token: the
train-inference mismatch (verl's `rollout_probs_diff`), which measures what the rollout engine's kernels,
dtype and weight sync change. Scoring at T 1 instead (`RolloutConfig.score_at_temperature=False`, the kit
before issue 37) gives the ratio of the untempered model, which is not the law the samples followed.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from ..train import Batch
from .correction import rollout_logprobs_like


@contextmanager
def scored_at(chunks, *, temperature: float):
    """Inside the block every forward of `chunks` divides its logits by `temperature` (a forward hook on the
    output layer, whose logits megatron's cross-entropy then reads: vocab-parallel under TP, so no gather).
    Temperature 1 or 0 (greedy sampling, scored at 1) installs nothing."""
    if temperature in (0, 1):
        yield
        return
    hooks = [m.register_forward_hook(lambda _m, _in, out: (out[0] / temperature, *out[1:]))
             for c in chunks for name, m in c.named_modules() if name.split(".")[-1] == "output_layer"]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def mismatch(rollout_logprobs: list[list[float]] | None, batch: Batch) -> dict:
    """Mean and max |logp_rollout - logp_trainer| over the sampled tokens: `batch.extras["old_logprobs"]` at its
    loss positions (row-major, completion after completion, as `core.rollout_batch` lays them out) against the
    backend's log-probs of the same tokens. NaN when the backend does not score."""
    if rollout_logprobs is None:
        return dict(logprob_diff_mean=math.nan, logprob_diff_max=math.nan)
    mask = batch.loss_mask
    return drift(drift_sums(batch.extras["old_logprobs"], rollout_logprobs_like(rollout_logprobs, mask), mask))


def drift_sums(trainer: torch.Tensor, rollout: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[tokens, sum |d|, max |d|] of d = rollout - trainer over the loss positions, on the device (no host sync:
    `rl.on_policy` adds them up per micro-batch, then over ranks)."""
    on = loss_mask.float()
    diff = (rollout.float() - trainer.float()).abs() * on
    return torch.stack([on.sum(), diff.sum(), diff.max()])


def drift(sums: torch.Tensor) -> dict:
    """logprob_diff_mean and logprob_diff_max from `drift_sums` (0 without loss tokens)."""
    tokens, total, top = sums.tolist()
    return dict(logprob_diff_mean=total / tokens if tokens else 0.0, logprob_diff_max=top if tokens else 0.0)


def routing_mismatch(chunks, rollouts, *, seq_len_tokens: int, pad_id: int, micro_batch_size: int) -> dict:
    """What MoE router replay changes (`RolloutConfig.router_replay`), on a `RolloutBatch` sampled with its routes
    (`core.collect(routes=True)`): `flips`, the share of (fed token, MoE layer) pairs whose experts the trainer's own
    router picks differently from the rollout's, and the log-prob mismatch (`drift`: mean and max over the
    completions' tokens) of the trainer scoring them at T 1 without replay and with it. Collective (every rank)."""
    from ..models import router_replay
    from ..train.generate import logits
    from .core import token_logprobs
    from .samples import rollout_batch
    n = len(rollouts.completions)
    ids = [rollouts.prompt_ids[i // rollouts.group_size] for i in range(n)]
    routed = rollout_batch(ids, rollouts.completions, torch.zeros(n), seq_len_tokens=seq_len_tokens, pad_id=pad_id,
                           routes=rollouts.routes)
    plain = Batch(routed.tokens, routed.labels, routed.loss_mask,
                  {k: v for k, v in routed.extras.items() if k != "routes"})
    with router_replay.recording(chunks) as rec:
        logits(chunks, plain.tokens)
    lengths = torch.tensor([len(p) + len(c) - 1 for p, c in zip(ids, rollouts.completions)])
    fed = torch.arange(seq_len_tokens)[None] < lengths[:, None]
    out = dict(flips=router_replay.flips(rec.routes(batch=n, seq=seq_len_tokens).cpu(), routed.extras["routes"],
                                         mask=fed), tokens=int(plain.loss_mask.sum()))
    behaviour = rollout_logprobs_like(rollouts.logprobs, plain.loss_mask)
    for name, batch in (("without", plain), ("with", routed)):
        trainer = token_logprobs(chunks, batch, micro_batch_size=micro_batch_size)
        d = drift(drift_sums(trainer, behaviour, plain.loss_mask))
        out.update({f"diff_mean_{name}": d["logprob_diff_mean"], f"diff_max_{name}": d["logprob_diff_max"]})
    return out
