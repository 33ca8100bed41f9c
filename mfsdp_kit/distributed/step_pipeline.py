"""The optimizer step as one pipeline of named stages, composed in one stated order.

Three features change what `optimizer.step()` does: the fp32 grads made a part at a time (`grad_upcast`), the
optimizer state streamed from host memory (`offload.stream_optimizer`, `EngineConfig.offload.optimizer_offload`), and
the memory peak of the step measured apart from forward/backward (`perf.peaks.record_step_phases`). The naive
way, each replacing `step` with a wrapper of whatever `step` is now, makes the order the order of the calls, and
nobody states it: timing installed before offload would not measure the reload. Here each feature adds a stage
by name and the pipeline composes every stage in ORDER, outermost first, whatever the order of the `add` calls:

    phase_timing   a phase boundary before and after (measures everything below it: reload, step, offload)
    offload        reload the optimizer state to the device, step, offload it again
    megatron       megatron's optimizer.step: grad norm, clip, each inner torch optimizer's step, main -> model
    grad_upcast    around each inner torch optimizer's step: run it a part of the params at a time
    adam           torch's Adam step

The first two wrap megatron's `optimizer.step`; `grad_upcast` wraps the `step` of each torch optimizer inside
megatron's (megatron must take the grad norm and the clip factor before any part is stepped).
tests/distributed/test_step_pipeline.py holds the order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..config import bad_value
from .introspect import inner_optimizers

OUTER = ("phase_timing", "offload")
"""Stages around megatron's `optimizer.step`, outermost first."""
INNER = ("grad_upcast",)
"""Stages around each inner torch optimizer's `step`, outermost first."""
ORDER = (*OUTER, "megatron", *INNER, "adam")
"""The whole step, outermost first (`megatron` and `adam` are the upstream steps themselves)."""

Wrap = Callable[[Callable, object], Callable]
"""`wrap(step, owner) -> new step`: `owner` is the optimizer whose step it wraps (megatron's for an OUTER stage,
each torch optimizer for an INNER one). Called again whenever the pipeline is composed: build closures only."""

_ATTR = "_mfsdp_kit_step_pipeline"


@dataclass
class Pipeline:
    """The untouched steps of one megatron optimizer and its inner torch optimizers, and the stages added."""
    optimizer: object
    base: Callable
    inner: list[tuple[object, Callable]]
    stages: dict[str, Wrap] = field(default_factory=dict)

    def compose(self) -> None:
        """Set `optimizer.step` (and each inner torch optimizer's `step`) to the stages in ORDER."""
        step = self.base
        for name in reversed(OUTER):
            if name in self.stages:
                step = self.stages[name](step, self.optimizer)
        self.optimizer.step = step
        for torch_opt, base in self.inner:
            inner_step = base
            for name in reversed(INNER):
                if name in self.stages:
                    inner_step = self.stages[name](inner_step, torch_opt)
            torch_opt.step = inner_step


def pipeline(optimizer) -> Pipeline:
    """The optimizer's pipeline, made (from its steps as they are now) at the first call."""
    pipe = getattr(optimizer, _ATTR, None)
    if pipe is None:
        torch_opts = [t for t in (getattr(o, "optimizer", None) for o in inner_optimizers(optimizer)) if t is not None]
        pipe = Pipeline(optimizer, optimizer.step, [(t, t.step) for t in torch_opts])
        setattr(optimizer, _ATTR, pipe)
    return pipe


def add(optimizer, *, stage: str, wrap: Wrap) -> None:
    """Put `wrap` at `stage`'s place in ORDER (replacing one added there before) and compose the step again."""
    if stage not in OUTER + INNER:
        raise bad_value("stage", stage, " | ".join(OUTER + INNER))
    pipe = pipeline(optimizer)
    pipe.stages[stage] = wrap
    pipe.compose()


def stages(optimizer) -> list[str]:
    """The stages added to this optimizer's step, outermost first."""
    pipe = getattr(optimizer, _ATTR, None)
    return [name for name in ORDER if pipe is not None and name in pipe.stages]
