"""Training steps: forward_backward over micro-batches (megatron's schedules) -> optimizer step.

The loss is the masked per-token mean over the WHOLE global batch: each micro-batch returns
(sum of masked token losses, token count); megatron sums the counts over micro-batches and
data-parallel ranks and scales the gradients by 1/total (`calculate_per_token_loss`). That
makes DDP and FSDP, and any micro-batch split, compute the same gradient - packed micro-batches too
(`mfsdp_kit.train.packing`: a token budget instead of a row count, no padding computed, the same sums and counts).
"""
from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Iterable

import torch
import torch.distributed as dist

from ..distributed import engine, introspect, keep_gathered, runtime, stop
from . import packing, token_budget
from ..config import ConfigError, bad_value
from .data import Batch  # noqa: F401  (train.Batch: the step's input, owned by data)
from .options import StepOptions, takes_options
from ..fieldtypes import COUNT, INDEX, checked_args


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
    metrics: dict = field(default_factory=dict)
    """Per-token means of what the loss function logs besides the loss (e.g. KL, clip fraction)."""


class NonFiniteLossError(RuntimeError):
    """Raised when loss or gradient norm is NaN/inf; names the step so a run can stop cleanly."""


class BadBatchError(NonFiniteLossError, ValueError):
    """A batch that cannot give a finite loss (NaN/inf in `loss_mask`); names the step and the field.

    Also a ValueError: the data, not the model, is wrong."""


class DeadModelWarning(RuntimeWarning):
    """Training runs on with a finite loss but has stopped learning (see `HealthWatch`)."""


log = logging.getLogger(__name__)


def data_parallel_slice(batch: Batch) -> Batch:
    """This rank's contiguous share of the global batch (TP/CP ranks of one replica share it)."""
    from megatron.core import parallel_state as ps
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if batch.num_sequences % dp:
        raise ConfigError(f"global batch of {batch.num_sequences} sequences does not split over "
                          f"{dp} data-parallel ranks; allowed: a multiple of {dp}")
    n = batch.num_sequences // dp
    return batch.slice(dp_rank * n, (dp_rank + 1) * n)


def micro_batches(batch: Batch, micro_batch_size: int) -> list[Batch]:
    if batch.num_sequences % micro_batch_size:
        raise bad_value("micro_batch_size", micro_batch_size,
                        f"a divisor of this rank's {batch.num_sequences} sequences")
    return [batch.slice(i, i + micro_batch_size) for i in range(0, batch.num_sequences, micro_batch_size)]


def masked_token_loss(mb: Batch, token_losses: torch.Tensor):
    """megatron loss_func: (sum of masked token losses, token count, {name: [sum, count]} to log).

    `token_losses` is the model's per-token cross entropy [batch, seq] (= -log p(label))."""
    mask = mb.loss_mask.float()
    loss_sum = (token_losses.float() * mask).sum()
    return loss_sum, mask.sum().to(torch.int), {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}


def _forward_step(loss_fn, data_iterator, model):
    mb = next(data_iterator)
    packing.replay_routes([model], mb)   # MoE routes the batch carries (models.router_replay)
    if isinstance(mb, packing.PackedMicroBatch):
        return mb.forward(model), packing.loss_func(loss_fn, mb)
    seq = mb.tokens.shape[1]
    position_ids = torch.arange(seq, device=mb.tokens.device).unsqueeze(0).expand_as(mb.tokens)
    output = model(mb.tokens, position_ids, None, labels=mb.labels)
    return output, partial(loss_fn, mb)


@takes_options
def forward_backward(chunks: list[torch.nn.Module], batch: Batch, *, options: StepOptions,
                     forward_only: bool = False) -> tuple[float, int, dict]:
    """Run megatron's schedule on this rank's slice.

    Returns (global per-token mean loss, global token count, {logged name: per-token mean}). `options`
    (`StepOptions`, or its fields as keywords) cuts the micro-batches and scores them: packed (`packing`; `packed`
    None: where the model can) they hold at most `max_tokens_per_micro_batch` tokens (None: what the device's memory
    holds, `packing.budget`; on CPU `micro_batch_size` rows' worth); padded, `micro_batch_size` rows each;
    `loss_fn(micro_batch, token_losses)` has `masked_token_loss`'s contract."""
    means, tokens = _read_logged(*_forward_backward(chunks, batch, options=options, forward_only=forward_only))
    return means.pop("lm loss"), tokens, means


@takes_options
def local_micro_batches(chunks, batch: Batch, *, options: StepOptions, forward_only: bool = False) -> list:
    """This rank's micro-batches on its device: packed (`packing.rank_micro_batches`) or padded rows."""
    device = runtime.current().device
    tokens = packing.budget(chunks, batch, options=options, forward_only=forward_only)
    if tokens is None:
        return micro_batches(data_parallel_slice(batch).to(device), options.micro_batch_size)
    return [mb.to(device) for mb in packing.rank_micro_batches(batch, max_tokens_per_micro_batch=tokens)]


def _forward_backward(chunks, batch: Batch, *, options: StepOptions,
                      forward_only: bool = False) -> tuple[list[str], torch.Tensor]:
    """`forward_backward` up to its numbers, which stay on the device: (logged names, [names, 2] float64
    sums and counts over micro-batches and data-parallel ranks)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    rt = runtime.current()
    mbs = local_micro_batches(chunks, batch, options=options, forward_only=forward_only)
    # measured: the first packed training call's peak bytes per token, which the next call's budget comes from
    largest = packing.largest_packed(mbs) if options.max_tokens_per_micro_batch is None else None
    measured = token_budget.measuring(chunks, largest=largest, forward_only=forward_only)
    loss_fn = options.loss_fn or masked_token_loss
    # held: a no-op unless built with fsdp_keep_gathered; routes: MoE routes the batch carries, replayed
    with keep_gathered.held(chunks), measured, packing.routes_replayed(chunks, batch):
        logged = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, loss_fn), data_iterator=iter(mbs), model=chunks,
            num_microbatches=len(mbs), seq_length=batch.tokens.shape[1], micro_batch_size=options.micro_batch_size,
            forward_only=forward_only)
        engine.settle_param_gathers(chunks)
    return _reduce_logged(logged, rt.device)


def _reduce_logged(logged: list[dict], device) -> tuple[list[str], torch.Tensor]:
    """Sum each logged [sum, count] over micro-batches and data-parallel ranks, on the device."""
    from megatron.core import parallel_state as ps
    names = sorted(logged[0]) if logged else ["lm loss"]
    total = torch.zeros(len(names), 2, dtype=torch.float64, device=device)
    for entry in logged:  # empty on non-last pipeline stages
        total += torch.stack([entry[n].to(torch.float64) for n in names])
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:  # the last stage holds the loss
        dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    return names, total


def _read_logged(names: list[str], total: torch.Tensor) -> tuple[dict, int]:
    """The host read of `_reduce_logged`'s sums (one copy, so one sync): per-token means, loss token count."""
    total = total.cpu()
    means = {n: (total[i, 0] / total[i, 1].clamp(min=1)).item() for i, n in enumerate(names)}
    return means, int(total[names.index("lm loss"), 1].item())


@dataclass
class PendingStep:
    """A step whose work is issued but whose numbers are still on the device (`start_step`)."""
    step_index: int
    names: list[str]
    totals: torch.Tensor
    grad_norm: torch.Tensor | float | None
    ok: bool
    lr: float
    start_s: float
    stuck: bool = False
    """Skipped with the loss scale already at its smallest: the gradients are not finite at any scale."""

    def result(self) -> StepResult:
        """Read the step's numbers (waits for its GPU work); NonFiniteLossError if the loss is NaN/inf, or the grad
        norm of a step taken. A step fp16's loss scaler skipped (its scaled gradients overflowed: the weights did not
        move and the scale backs off) is no error: `skipped`, with a NaN grad norm; one skipped at the smallest scale
        is (no scale makes its gradients finite, and every later step would be skipped too)."""
        means, tokens = _read_logged(self.names, self.totals)
        loss = means.pop("lm loss")
        grad_norm = float("nan") if self.grad_norm is None else float(self.grad_norm)
        if not math.isfinite(loss) or (self.ok and not math.isfinite(grad_norm)) or self.stuck:
            why = " (skipped at the smallest fp16 loss scale: its gradients overflow at every scale)" * self.stuck
            raise NonFiniteLossError(f"step {self.step_index}: loss={loss} grad_norm={grad_norm} is not finite{why}; "
                                     "training stopped (the weights may hold this update, and those of any step "
                                     "started after it: resume from the last checkpoint, lower the lr or check "
                                     "the data)")
        return StepResult(loss=loss, grad_norm=grad_norm, tokens=tokens, lr=self.lr,
                          step_time_s=time.perf_counter() - self.start_s, skipped=not self.ok, metrics=means)


@takes_options
@checked_args(step_index=INDEX)
def start_step(chunks: list[torch.nn.Module], optimizer, batch: Batch, *, options: StepOptions,
               step_index: int = 0) -> PendingStep:
    """Issue one optimizer step (zero grads, forward/backward, finalize, step; `options` as `forward_backward`
    says, its scheduler stepped) without reading anything on the host: in bf16 on GPUs nothing in it waits for the
    GPU (`engine.finalize_grads`, `compat.patches.grad_norm`, pinned batch copies). So a loop that starts step i+1
    before it reads step i (`.result()`) keeps the GPU fed across the step boundary, where the first forward's host
    work would otherwise leave it idle."""
    start = time.perf_counter()
    check_batch(batch, step_index=step_index)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    # models of one model_fn (a policy and its critic) share one TransformerConfig: its schedule hooks (no_sync, and
    # fp16's loss scale) point at whichever was built last, so each step points them at its own model and optimizer
    engine.attach_schedule_hooks(chunks)
    engine.scale_loss_by(chunks, optimizer)
    names, totals = _forward_backward(chunks, batch, options=options)
    floor = introspect.loss_scale_at_floor(optimizer)   # fp16 only (it syncs, as fp16's step does): bf16 reads nothing
    ok, grad_norm, _ = optimizer.step()
    if ok:   # a Python bool (megatron reads fp16's found-inf on the host; bf16 always steps)
        token_budget.optimizer_stepped(chunks)
    engine.settle_param_gathers(chunks)  # the step starts the next forward's all-gathers
    if options.scheduler is not None and ok:   # a skipped step takes no share of the warm-up (as megatron.training)
        options.scheduler.step(increment=1)
    return PendingStep(step_index=step_index, names=names, totals=totals, grad_norm=grad_norm, ok=ok,
                       lr=optimizer.param_groups[0]["lr"], start_s=start,
                       stuck=not ok and floor)


@takes_options
@checked_args(step_index=INDEX)
def step(chunks: list[torch.nn.Module], optimizer, batch: Batch, *, options: StepOptions, step_index: int = 0,
         watch: HealthWatch | None = None) -> StepResult:
    """One optimizer step over a global batch: zero grads, forward/backward, finalize, step; its numbers read.
    `watch` (`HealthWatch.of(chunks)`, kept across steps) warns when the run stops learning. `options`
    (`StepOptions`, or its fields as keywords): micro-batches, loss and scheduler, as `forward_backward` says."""
    result = start_step(chunks, optimizer, batch, options=options, step_index=step_index).result()
    if watch is not None:
        watch(step_index, result)
    return result


@takes_options
@checked_args(start_index=INDEX)
def run_steps(chunks: list[torch.nn.Module], optimizer, batches: Iterable[Batch], *, options: StepOptions,
              start_index: int = 0) -> list[StepResult]:
    """One `step` per batch, each issued (`start_step`) before the previous one's numbers are read: the host work
    that opens a step (its micro-batches, the first forward's launches) runs while the GPU still works on the
    step before, instead of after a sync that left the GPU idle. The same updates and numbers as `step` in a
    loop, for loops with nothing between steps (a checkpoint between steps needs `step`: here the next step is
    already queued). A non-finite step raises when read, one step later (`PendingStep.result`)."""
    results, pending = [], None
    for i, batch in enumerate(batches, start=start_index):
        issued = start_step(chunks, optimizer, batch, options=options, step_index=i)
        if pending is not None:
            results.append(pending.result())
        pending = issued
    if pending is not None:
        results.append(pending.result())
    return results


def check_batch(batch: Batch, *, step_index: int) -> None:
    """Refuse a batch whose loss_mask is not finite, naming the step.

    Unchecked, a NaN in the mask makes the token count NaN and the step dies in `_reduce_logged`
    with "cannot convert float NaN to integer", naming nothing. Every rank holds the same global
    batch, so every rank raises here: no rank is left waiting in a collective."""
    bad = ~torch.isfinite(batch.loss_mask.float())
    if bad.any():
        where = bad.nonzero()[0].tolist()
        raise BadBatchError(f"step {step_index}: loss_mask holds {int(bad.sum())} non-finite value(s) (first at "
                            f"[sequence, position] = {where}); allowed: finite weights, 1.0 = in the loss, 0.0 = not. "
                            "Check the data pipeline that built this batch")


class HealthWatch:
    """Warns (warnings + logging, naming the step) when a run is alive but no longer learning: once per episode.

    `NonFiniteLossError` catches a run that blows up; it misses one that dies quietly. At lr 1e6 the
    tiny model's weights saturate on the first step: from then on the logits are flat, so the loss
    sits at ln(vocab) -- a uniform guess -- and the gradient norm is exactly 0.0, step after step,
    with no error. Signs watched: a grad norm of exactly 0.0 after a non-zero one (clip_grad=0 reports
    0.0 from the start, so that alone is not a sign), and a loss within `rel_tol` of ln(vocab_size)
    for `patience_steps` steps in a row. A step with no loss tokens (a loss_mask of zeros) reports loss
    0.0 and grad norm 0.0 whatever the model: it is skipped, and said so. An episode ends at the first step
    without a sign, so a collapse after a recovery warns again.

    In a loop of your own: `watch = HealthWatch.of(chunks)`, then `train.step(..., watch=watch)` (or
    `watch(step_index, result)`); `fit` does this for you."""

    def __init__(self, *, vocab_size: int | None, patience_steps: int = 5, rel_tol: float = 1e-3):
        self.uniform_loss = math.log(vocab_size) if vocab_size else None
        self.patience_steps, self.rel_tol = patience_steps, rel_tol
        self.seen_nonzero_grad, self.uniform_run, self.warned = False, 0, False

    @classmethod
    def of(cls, chunks: list[torch.nn.Module], **kwargs) -> "HealthWatch":
        """A watch for this (wrapped) model: its vocabulary gives the uniform-guess loss."""
        return cls(vocab_size=vocab_size_of(chunks), **kwargs)

    def __call__(self, step_index: int, result: StepResult) -> None:
        if result.tokens == 0:
            message = (f"step {step_index}: the global batch has no loss tokens (its loss_mask is all 0), so its "
                       f"loss {result.loss} and grad norm {result.grad_norm} say nothing; the dead-model watch skips it")
            log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            return
        signs = []
        if not result.skipped:   # a step fp16's loss scaler skipped has no grad norm (NaN) to judge
            if result.grad_norm == 0.0 and self.seen_nonzero_grad:
                signs.append("gradient norm is exactly 0.0 after non-zero ones")
            self.seen_nonzero_grad |= result.grad_norm != 0.0
        uniform = self.uniform_loss is not None and math.isclose(result.loss, self.uniform_loss, rel_tol=self.rel_tol)
        self.uniform_run = self.uniform_run + 1 if uniform else 0
        if self.uniform_run >= self.patience_steps:
            signs.append(f"loss {result.loss:.4f} has equalled ln(vocab) = {self.uniform_loss:.4f} (a "
                         f"uniform guess) for {self.uniform_run} steps")
        if signs and not self.warned:
            self._warn(step_index, signs[0])
        self.warned = bool(signs)   # a step without a sign ends the episode

    def _warn(self, step_index: int, what: str) -> None:
        message = (f"step {step_index}: {what}: the model has stopped learning (a dead model; too high an lr? "
                   "lr=1e6 does this). Training continues; lower the lr and restart from a checkpoint")
        log.warning(message)
        warnings.warn(message, DeadModelWarning, stacklevel=3)


def vocab_size_of(chunks: list[torch.nn.Module]) -> int | None:
    """The vocabulary size of the (wrapped) megatron model, None if it does not say."""
    return getattr(engine.unwrap_model(chunks[-1]), "vocab_size", None)


@dataclass
class History:
    """Per-step metrics of a `fit` run (lists indexed by step)."""

    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    memory_bytes: list[int] = field(default_factory=list)
    """Peak accelerator memory of this rank after each step (0 on CPU)."""
    stopped_at: int | None = None
    """The step index a Stop ended the run before (`distributed.stop`), None when it ran to the end."""

    def append(self, r: StepResult) -> None:
        self.loss.append(r.loss)
        self.grad_norm.append(r.grad_norm)
        self.lr.append(r.lr)
        self.tokens_per_s.append(r.tokens / max(r.step_time_s, 1e-9))
        self.memory_bytes.append(torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0)


@takes_options
@checked_args(steps=COUNT, start_step=INDEX)
def fit(chunks: list[torch.nn.Module], optimizer, batches, *, steps: int, options: StepOptions, start_step: int = 0,
        on_step=None, progress: bool = True) -> History:
    """Run `steps` optimizer steps over the iterator `batches`, each a `step` with `options` (`StepOptions`, or its
    fields as keywords: `fit(..., micro_batch_size=4, scheduler=sched)`); returns the per-step History.

    Progress shows as a tqdm bar on rank 0 in scripts, and is reported to whoever listens (`distributed.progress`:
    the cluster widget on ipyparallel engines). `on_step(step, result)` runs after every step (e.g. to checkpoint,
    or draw a live panel); a non-finite loss raises NonFiniteLossError naming the step, and a run that
    stops learning (`HealthWatch`) warns once per episode, naming the step.
    On a notebook engine, Stop ends the run between two steps, the same one on every rank (`distributed.stop`):
    the History so far is returned with `stopped_at` set, and `fit(..., start_step=stopped_at, steps=the rest)`
    continues exactly as the uninterrupted run would have.
    """
    from tqdm.auto import tqdm

    from ..distributed.progress import report
    history = History()
    rank0 = runtime.current().rank == 0
    bar = tqdm(total=steps, desc="train", disable=not (progress and rank0))
    watch = HealthWatch.of(chunks)
    end = start_step + steps
    with stop.stoppable():
        for i in range(start_step, end):
            if stop.agreed():   # before the batch is drawn: the iterator stays at step i
                history.stopped_at = i
                stop.record(what="train.fit", step=i, total=end, resume=f"fit(..., start_step={i}, steps={end - i})")
                break
            result = step(chunks, optimizer, next(batches), options=options, step_index=i, watch=watch)
            history.append(result)
            bar.update(1)
            bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{result.lr:.2e}")
            report(step=i + 1, total=end, loss=result.loss, tokens_per_s=history.tokens_per_s[-1])
            if on_step is not None:
                on_step(i, result)
    bar.close()
    return history
