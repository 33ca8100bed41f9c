"""How a step cuts and scores its micro-batches: `StepOptions`, one dataclass passed whole.

The naive loop threads five keywords (micro_batch_size, max_tokens_per_micro_batch, packed, loss_fn, scheduler)
by hand from `fit` down to the function that cuts the micro-batches, each re-declared with its default and its
check at every level; a new option means editing every signature on the way. Here they are one frozen dataclass,
checked when made, handed down whole: each function reads the fields it needs (`token_logprobs` the first three,
`start_step` all five).

The keywords stay the short spelling of the public functions: `fit(..., micro_batch_size=4, scheduler=sched)`
is `fit(..., options=StepOptions(micro_batch_size=4, scheduler=sched))`. `takes_options` turns one into the
other, the one place that does, so what a user typed before StepOptions keeps working, without a warning.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any, Callable

from ..fieldtypes import COUNT, Range, bad_value, check_ranges, optional


@dataclass(kw_only=True, frozen=True)
class StepOptions:
    """What `train.forward_backward`, `step`, `run_steps`, `fit` and the RL passes (`rl.core.token_logprobs`,
    `update`; `rl.critic.values`, `update`) are given besides the model, its optimizer and the batch."""

    micro_batch_size: int
    """Rows (sequences) per padded micro-batch on each data-parallel rank: a divisor of the rank's share of the
    global batch. Any size gives the same gradient (the loss is the global per-token mean); larger means fewer
    forwards and, with Megatron-FSDP, fewer all-gathers. Packed, it sets the CPU token budget (this many rows)."""
    max_tokens_per_micro_batch: int | None = None
    """Tokens per packed micro-batch (`train.packing`: at least the longest sequence, which is never split); None:
    what the device's memory holds (`train.token_budget.memory_budget`), on CPU `micro_batch_size` rows' worth.
    Padded micro-batches ignore it."""
    packed: bool | None = None
    """Pack each micro-batch's sequences end to end, no padding computed (`train.packing`): None where the model
    can (`packing.can_pack`: attention_backend "sdpa" or "flex", one pipeline stage), True (or an error), False
    (padded rows of `micro_batch_size`)."""
    loss_fn: Callable | None = None
    """`loss_fn(micro_batch, token_losses)` -> (sum of token losses, token count, {logged name: [sum, count]}):
    megatron divides the summed sums by the summed counts over micro-batches and data-parallel ranks. None:
    `train.masked_token_loss` (the masked per-token mean)."""
    scheduler: Any = None
    """The learning-rate scheduler (`engine.build_scheduler`), stepped once per optimizer step taken (a step fp16's
    loss scaler skipped takes no share of the warm-up); None: the lr stays."""

    def __post_init__(self):
        """Checked when made, so a wrong option fails at the call, before any forward."""
        self.validate()

    def validate(self) -> None:
        """Raise `ConfigError` naming the first field that is not allowed, its value and what is."""
        check_ranges(self, ALLOWED)


ALLOWED: dict[str, Range] = {
    "micro_batch_size": COUNT,
    "max_tokens_per_micro_batch": optional(COUNT),
    "packed": (lambda v: v is None or isinstance(v, bool), "None (where the model can) | True | False"),
    "loss_fn": (lambda v: v is None or callable(v),
                "None (train.masked_token_loss) or a function (micro_batch, token_losses) -> (sum, count, logged)"),
    "scheduler": (lambda v: v is None or callable(getattr(v, "step", None)),
                  "None or a scheduler with step(increment=) (engine.build_scheduler)"),
}
"""Each field's check (`validate`), in the order a wrong one is named. Plain checks, no annotation walk: options
built from keywords are made at every call."""

FIELDS = frozenset(f.name for f in fields(StepOptions))
"""The keywords `takes_options` gathers into a StepOptions."""


def takes_options(fn):
    """Decorator of a function with a keyword `options: StepOptions`: it may also be called with StepOptions'
    fields as keywords (`micro_batch_size=4, packed=False`), which build its options here. Both at once is an
    error: one call, one source of options."""
    @functools.wraps(fn)
    def call(*args, options: StepOptions | None = None, **kwargs):
        given = {name: kwargs.pop(name) for name in FIELDS & kwargs.keys()}
        if options is None:
            options = StepOptions(**given)
        elif given:
            raise TypeError(f"{fn.__qualname__}() takes options= or its fields as keywords, not both "
                            f"(given: options and {', '.join(sorted(given))})")
        elif not isinstance(options, StepOptions):
            raise bad_value("options", options, "a train.StepOptions")
        return fn(*args, options=options, **kwargs)
    return call
