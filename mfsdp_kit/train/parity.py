"""Is run B the same training as run A? Compare two loss curves the way float arithmetic allows.

Two wrappers that compute the same gradients (DDP and Megatron-FSDP, or two micro-batch splits)
still add the same numbers in a different order: DDP all-reduces full gradients, FSDP
reduce-scatters them into shards, and the gradient norm is a sum of per-shard partial sums.
In fp32 (unit roundoff u = 6e-8) that changes a result by a few u, never more than ~1e-6 relative
for the sums here. So:

* **Early steps are compared tightly.** At step 1 both runs see identical weights and data, so
  loss and gradient norm can differ only by reduction order: ~1e-7 relative measured, `rtol`
  1e-5 allows 100x that. For the next few steps (a warm-up: small lr) the weights differ by a few
  roundoffs and the losses by a few 1e-8; `exact_steps` is where we still demand `rtol`.
* **Later steps are compared statistically.** Training amplifies any difference: each Adam step
  divides by sqrt(v), so a 1e-8 weight difference in a direction with a tiny gradient becomes an
  lr-sized one, and the two runs separate exponentially (measured on the tiny model at lr 3e-3:
  from 1e-7 to 1e-5 within ~10 steps once it starts, at step 25 to 60 depending on the data and
  on which ATen kernels the CPU runs: `ATEN_CPU_CAPABILITY`). After that they are two samples of
  the same noisy process, so a per-step tolerance only measures the CPU. What must still hold is
  that both reach the same loss level: the gap between the two runs' median losses over the last
  `late_window` steps must stay within `noise_multiple` times the runs' own step-to-step spread
  (the interquartile range of those same steps, averaged over the two runs). A real bug (a
  gradient scaled wrong, a shard never updated) shows at step 1 already, and as a gap of many
  spreads later.

    report = compare_curves(ddp.loss, fsdp.loss, reference_grad_norm=ddp.grad_norm,
                            candidate_grad_norm=fsdp.grad_norm)
    print(report)
    report.check()        # AssertionError with the numbers when it does not hold
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..config import bad_value


def relative_differences(a: list[float], b: list[float]) -> list[float]:
    """|a_i - b_i| / max(|a_i|, |b_i|) per step (0 where both are 0)."""
    return [abs(x - y) / max(abs(x), abs(y)) if (x or y) else 0.0 for x, y in zip(a, b)]


@dataclass
class CurveParity:
    """What `compare_curves` measured, next to the bounds it holds the runs to."""

    exact_steps: int
    """Leading steps compared per step against `rtol`."""
    rtol: float
    worst_exact: float
    """Largest relative difference of loss (and grad norm, when given) over `exact_steps`."""
    worst_exact_step: int
    """The step (0-based) where `worst_exact` occurred."""
    late_window: int
    """Trailing steps compared statistically (0: none)."""
    late_gap: float = 0.0
    """|median(reference) - median(candidate)| over the trailing window."""
    late_tolerance: float = 0.0
    """noise_multiple x the mean interquartile range of the two windows."""

    @property
    def ok(self) -> bool:
        return self.worst_exact <= self.rtol and self.late_gap <= self.late_tolerance

    @property
    def exact_margin(self) -> float:
        """How many times `worst_exact` fits into `rtol` (inf when the runs agree bitwise)."""
        return self.rtol / self.worst_exact if self.worst_exact else float("inf")

    @property
    def late_margin(self) -> float:
        return self.late_tolerance / self.late_gap if self.late_gap else float("inf")

    def __str__(self) -> str:
        text = (f"first {self.exact_steps} steps: worst relative difference {self.worst_exact:.1e} "
                f"(step {self.worst_exact_step}) vs rtol {self.rtol:.0e}")
        if self.late_window:
            text += (f"; last {self.late_window} steps: median gap {self.late_gap:.4f} vs "
                     f"{self.late_tolerance:.4f} allowed")
        return text

    def check(self) -> "CurveParity":
        """Raise AssertionError naming what differs; return self so calls chain."""
        if self.worst_exact > self.rtol:
            raise AssertionError(f"the runs differ beyond reduction order in their first {self.exact_steps} "
                                 f"steps: {self}")
        if self.late_gap > self.late_tolerance:
            raise AssertionError(f"the runs reach different loss levels: {self}")
        return self


def _iqr(values: list[float]) -> float:
    q1, _, q3 = statistics.quantiles(values, n=4)
    return q3 - q1


def compare_curves(reference_loss: list[float], candidate_loss: list[float], *, exact_steps: int = 10,
                   rtol: float = 1e-5, late_window: int = 0, noise_multiple: float = 3.0,
                   reference_grad_norm: list[float] | None = None,
                   candidate_grad_norm: list[float] | None = None) -> CurveParity:
    """Compare two per-step loss curves (and optionally grad norms) of runs that should be the same.

    `exact_steps` leading steps: loss (and grad norm) within `rtol` relative, step by step.
    `late_window` trailing steps (0 = skip): median gap <= `noise_multiple` x mean IQR.
    """
    if len(reference_loss) != len(candidate_loss):
        raise ValueError(f"the curves have {len(reference_loss)} and {len(candidate_loss)} steps; "
                         "compare runs of the same length")
    if not 1 <= exact_steps <= len(reference_loss):
        raise bad_value("exact_steps", exact_steps, f"1 .. {len(reference_loss)}")
    if late_window and not 4 <= late_window <= len(reference_loss):
        raise bad_value("late_window", late_window, f"0 or 4 .. {len(reference_loss)}")
    diffs = relative_differences(reference_loss[:exact_steps], candidate_loss[:exact_steps])
    if reference_grad_norm is not None and candidate_grad_norm is not None:
        grads = relative_differences(reference_grad_norm[:exact_steps], candidate_grad_norm[:exact_steps])
        diffs = [max(d, g) for d, g in zip(diffs, grads)]
    worst_step = max(range(len(diffs)), key=diffs.__getitem__)
    report = CurveParity(exact_steps=exact_steps, rtol=rtol, worst_exact=diffs[worst_step],
                         worst_exact_step=worst_step, late_window=late_window)
    if late_window:
        a, b = reference_loss[-late_window:], candidate_loss[-late_window:]
        report.late_gap = abs(statistics.median(a) - statistics.median(b))
        report.late_tolerance = noise_multiple * (_iqr(a) + _iqr(b)) / 2
    return report
