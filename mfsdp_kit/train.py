"""Training steps: forward_backward over micro-batches (megatron's schedules) -> optimizer step.

The loss is the masked per-token mean over the WHOLE global batch: each micro-batch returns
(sum of masked token losses, token count); megatron sums the counts over micro-batches and
data-parallel ranks and scales the gradients by 1/total (`calculate_per_token_loss`). That
makes DDP and FSDP, and any micro-batch split, compute the same gradient.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from . import runtime
from .engine import unwrap_model


@dataclass
class Batch:
    """One global batch: every rank holds the same tensors and takes its data-parallel slice."""

    tokens: torch.Tensor
    """[batch, seq] input token ids."""
    labels: torch.Tensor
    """[batch, seq] next-token targets."""
    loss_mask: torch.Tensor
    """[batch, seq] 1.0 where the token counts in the loss (e.g. the answer), else 0.0."""

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    def slice(self, start: int, stop: int) -> "Batch":
        return Batch(self.tokens[start:stop], self.labels[start:stop], self.loss_mask[start:stop])

    def to(self, device) -> "Batch":
        return Batch(self.tokens.to(device), self.labels.to(device), self.loss_mask.to(device))


@dataclass
class StepResult:
    loss: float
    """Masked per-token mean loss over the global batch."""
    grad_norm: float
    """Global grad norm before clipping."""
    tokens: int
    """Tokens in the loss over the global batch (all data-parallel ranks)."""
    lr: float
    step_time_s: float
    skipped: bool = False


class NonFiniteLossError(RuntimeError):
    """Raised when loss or gradient norm is NaN/inf; names the step so a run can stop cleanly."""


def data_parallel_slice(batch: Batch) -> Batch:
    """This rank's contiguous share of the global batch (TP/CP ranks of one replica share it)."""
    from megatron.core import parallel_state as ps
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if batch.num_sequences % dp:
        raise ValueError(f"global batch of {batch.num_sequences} sequences does not split over "
                         f"{dp} data-parallel ranks; use a multiple of {dp}")
    n = batch.num_sequences // dp
    return batch.slice(dp_rank * n, (dp_rank + 1) * n)


def micro_batches(batch: Batch, micro_batch_size: int) -> list[Batch]:
    if batch.num_sequences % micro_batch_size:
        raise ValueError(f"micro_batch_size={micro_batch_size} does not divide this rank's "
                         f"{batch.num_sequences} sequences; allowed: a divisor of {batch.num_sequences}")
    return [batch.slice(i, i + micro_batch_size) for i in range(0, batch.num_sequences, micro_batch_size)]


def masked_token_loss(loss_mask: torch.Tensor, output: torch.Tensor):
    """megatron loss_func: (sum of masked losses, token count, [sum, count] for logging)."""
    mask = loss_mask.reshape(-1).float()
    loss_sum = (output.float().reshape(-1) * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}


def _forward_step(data_iterator, model):
    mb = next(data_iterator)
    seq = mb.tokens.shape[1]
    position_ids = torch.arange(seq, device=mb.tokens.device).unsqueeze(0).expand_as(mb.tokens)
    output = model(mb.tokens, position_ids, None, labels=mb.labels)
    return output, partial(masked_token_loss, mb.loss_mask)


def forward_backward(chunks: list[torch.nn.Module], batch: Batch, *, micro_batch_size: int,
                     forward_only: bool = False) -> tuple[float, int]:
    """Run megatron's schedule on this rank's slice; return (global mean loss, global token count)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    rt = runtime.current()
    local = data_parallel_slice(batch).to(rt.device)
    mbs = micro_batches(local, micro_batch_size)
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(mbs), model=chunks, num_microbatches=len(mbs),
        seq_length=local.tokens.shape[1], micro_batch_size=micro_batch_size, forward_only=forward_only)
    return _reduce_loss(losses, rt.device)


def _reduce_loss(losses: list[dict], device) -> tuple[float, int]:
    """Sum (loss, tokens) over micro-batches and data-parallel ranks -> per-token mean."""
    from megatron.core import parallel_state as ps
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for entry in losses:  # empty on non-last pipeline stages
        total += entry["lm loss"].to(torch.float64)
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:  # the last stage holds the loss
        dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    return (total[0] / total[1].clamp(min=1)).item(), int(total[1].item())


def step(chunks: list[torch.nn.Module], optimizer, batch: Batch, *, micro_batch_size: int,
         scheduler=None, step_index: int = 0) -> StepResult:
    """One optimizer step over a global batch: zero grads, forward/backward, finalize, step."""
    start = time.perf_counter()
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    loss, tokens = forward_backward(chunks, batch, micro_batch_size=micro_batch_size)
    ok, grad_norm, _ = optimizer.step()
    grad_norm = float("nan") if grad_norm is None else float(grad_norm)
    if not math.isfinite(loss) or not math.isfinite(grad_norm):
        raise NonFiniteLossError(f"step {step_index}: loss={loss} grad_norm={grad_norm}; "
                                 "stopping before the non-finite update is used (lower lr or check the data)")
    if scheduler is not None:
        scheduler.step(increment=1)
    lr = optimizer.param_groups[0]["lr"]
    return StepResult(loss=loss, grad_norm=grad_norm, tokens=tokens, lr=lr,
                      step_time_s=time.perf_counter() - start, skipped=not ok)


@dataclass
class History:
    """Per-step metrics of a `fit` run (lists indexed by step)."""

    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    memory_bytes: list[int] = field(default_factory=list)
    """Peak accelerator memory of this rank after each step (0 on CPU)."""

    def append(self, r: StepResult) -> None:
        self.loss.append(r.loss)
        self.grad_norm.append(r.grad_norm)
        self.lr.append(r.lr)
        self.tokens_per_s.append(r.tokens / max(r.step_time_s, 1e-9))
        self.memory_bytes.append(torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0)


def fit(chunks: list[torch.nn.Module], optimizer, batches, *, steps: int, micro_batch_size: int,
        scheduler=None, start_step: int = 0, on_step=None, progress: bool = True) -> History:
    """Run `steps` optimizer steps over the iterator `batches`; returns the per-step History.

    Progress shows as a tqdm bar on rank 0 in scripts, and as the cluster widget when running
    on ipyparallel engines (`cluster.report`). `on_step(step, result)` runs after every step
    (e.g. to checkpoint); a non-finite loss raises NonFiniteLossError naming the step.
    """
    from tqdm.auto import tqdm

    from .cluster import report
    history = History()
    rank0 = runtime.current().rank == 0
    bar = tqdm(total=steps, desc="train", disable=not (progress and rank0))
    for i in range(start_step, start_step + steps):
        result = step(chunks, optimizer, next(batches), micro_batch_size=micro_batch_size,
                      scheduler=scheduler, step_index=i)
        history.append(result)
        bar.update(1)
        bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{result.lr:.2e}")
        report(step=i + 1, total=start_step + steps, loss=result.loss, tokens_per_s=history.tokens_per_s[-1])
        if on_step is not None:
            on_step(i, result)
    bar.close()
    return history
