"""The largest model that trains: calibrate on two sizes, predict with a line, verify around it.

Peak device memory of a GPT of L layers (same width, batch, sequence) is close to a line,
    peak(L) = fixed + per_layer * L
fixed: embeddings, output layer, logits, communication buffers; per_layer: one layer's model
state (16 B/param / N under ZeRO-3, 10 B/param at N = 2 under ZeRO-1) plus its activations.
Two trained sizes fit the line; L* = floor((cap - fixed) / per_layer) is the prediction, and the
search then trains L*, steps `layer_step` up while it trains and down while it runs out of
memory, until the largest size that trained and the smallest that did not are `layer_step` apart.
The trials themselves (build, train, catch the OOM, agree across ranks) are the caller's: this
module only decides which sizes to try, so it runs without a device (tests/perf drive it with a
fake one).

The other capacity question, tokens/s under a memory cap (bench/memory_cap.py): `candidates` reads
throughput runs, `best_under` picks each system's fastest setting whose measured peak fits.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Callable

from ..models.gpt import GPTSpec
from .variants import TRAINERS

Trial = Callable[[int, str], dict]
"""trial(layers, purpose) -> {"trained": bool, "oom": bool, "error": str | None, "peak_reserved_bytes": int, ...};
purpose is "calibrate", "size" (no device memory to search) or "verify"."""


def fit_line(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least-squares (fixed, per_layer) of bytes = fixed + per_layer * layers over (layers, bytes)."""
    n = len(points)
    if n < 2 or len({x for x, _ in points}) < 2:
        raise ValueError(f"need two distinct layer counts to fit a line, got {points}")
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


def predict_layers(cap_bytes: float, fixed: float, per_layer: float, *, min_layers: int = 1) -> int:
    """Most layers whose predicted peak fits under `cap_bytes` (at least `min_layers`)."""
    if per_layer <= 0:
        raise ValueError(f"per-layer bytes must be positive, got {per_layer}")
    return max(min_layers, math.floor((cap_bytes - fixed) / per_layer))


def next_layers(trials: list[tuple[int, bool]], *, step: int, min_layers: int = 1) -> int | None:
    """Next layer count to try after `trials` [(layers, trained)], or None once the largest that
    trained and the smallest that OOMed are at most `step` apart: `step` up from a success, down
    from an OOM, the middle of the bracket if that step would leave it."""
    hi_ok = max((n for n, trained in trials if trained), default=None)
    lo_oom = min((n for n, trained in trials if not trained), default=None)
    bracket = hi_ok is not None and lo_oom is not None
    if bracket and lo_oom - hi_ok <= step:
        return None
    last, trained = trials[-1]
    nxt = last + step if trained else last - step
    if bracket and not hi_ok < nxt < lo_oom:
        nxt = (hi_ok + lo_oom) // 2
    return nxt if nxt >= min_layers else None


def search(trial: Trial, base: GPTSpec, *, calib_layers: list[int], layer_step: int, max_trials: int,
           cap_bytes: Callable[[], float] | None) -> dict:
    """Calibrate on `calib_layers`, predict, verify (at most `max_trials` more trials); a summary.

    `cap_bytes()` is the device memory a trial may use, asked once the calibration trained;
    None = no device memory to search (CPU): train `max_trials` larger sizes instead."""
    params = lambda layers: replace(base, num_layers=layers).param_count()  # noqa: E731
    calib = [(n, trial(n, "calibrate")) for n in calib_layers]
    if not all(t["trained"] for _, t in calib):
        return dict(error="a calibration size did not train")
    if cap_bytes is None:
        sizes = [calib_layers[-1] + (i + 1) * layer_step for i in range(max_trials)]
        trained = [n for n, _ in calib] + [n for n in sizes if trial(n, "size")["trained"]]
        return dict(largest_trained_layers=max(trained), largest_trained_params=params(max(trained)))
    fixed, per_layer = fit_line([(n, t["peak_reserved_bytes"]) for n, t in calib])
    predicted = predict_layers(cap_bytes(), fixed, per_layer, min_layers=1)
    summary = dict(fixed_bytes=fixed, per_layer_bytes=per_layer, predicted_layers=predicted)
    history = [(n, t["trained"]) for n, t in calib]
    layers = predicted
    for _ in range(max_trials):
        t = trial(layers, "verify")
        if not t["trained"] and not t["oom"]:
            summary["error"] = t["error"]
            break
        history.append((layers, t["trained"]))
        layers = next_layers(history, step=layer_step)
        if layers is None:
            break
    largest = max((n for n, trained in history if trained), default=None)
    smallest_oom = min((n for n, trained in history if not trained), default=None)
    summary.update(largest_trained_layers=largest, smallest_oom_layers=smallest_oom,
                   bracketed=largest is not None and smallest_oom is not None and smallest_oom - largest <= layer_step)
    if largest is not None:
        summary["largest_trained_params"] = params(largest)
    return summary


def params_ratio(summaries: dict, *, numerator: str = "fsdp", denominator: str = "ddp") -> float | None:
    """Largest trained params of one mode over another's (None unless both found one)."""
    a, b = summaries.get(numerator, {}), summaries.get(denominator, {})
    if a.get("largest_trained_params") and b.get("largest_trained_params"):
        return a["largest_trained_params"] / b["largest_trained_params"]
    return None


# ---- tokens/s under a memory cap -------------------------------------------------------------
def candidates(paths: list[str]) -> list[dict]:
    """One row per successful mode of each file: system, micro-batch, recompute, tokens/s, peak GiB."""
    rows = []
    for path in paths:
        run = json.load(open(path))
        for mode, r in run["results"].items():
            if "error" in r:
                continue
            rows.append(dict(system=r["variant"]["trainer"], mode=mode, file=path.rsplit("/", 1)[-1],
                             micro_batch_size=run["args"]["micro_batch_size"],
                             recompute=r["variant"]["config"]["recompute"],
                             tokens_per_s_per_gpu=r["tokens_per_s_per_gpu"], mfu=r["mfu"],
                             peak_gib=r["peak_bytes"] / 2**30))
    return rows


def best_under(rows: list[dict], cap_gib: float) -> dict[str, dict | None]:
    """Per system, the fastest row whose peak is at most `cap_gib` (None: nothing fits)."""
    out = {}
    for system in TRAINERS:
        fits = [r for r in rows if r["system"] == system and r["peak_gib"] <= cap_gib]
        out[system] = max(fits, key=lambda r: r["tokens_per_s_per_gpu"]) if fits else None
    return out
