"""matplotlib pictures of a run: loss curves, per-rank memory next to the ZeRO formula, rewards.

Every function builds its own `Figure` (no pyplot global state, so it is safe with the Agg
backend in scripts and CI and inside a notebook alike), returns it, and writes a PNG when
`path` is given. In a notebook the returned Figure displays itself as the cell's value (`_show_in_ipython`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from matplotlib.figure import Figure


def _show_in_ipython() -> None:
    """Have IPython draw a bare `Figure` as a PNG. It does so only once a backend has been activated (pyplot imported,
    or `%matplotlib inline`), which this module never does: without this a cell's Figure showed as its text,
    `<Figure size 640x360 with 1 Axes>`."""
    try:
        from IPython import get_ipython
        from IPython.core.pylabtools import select_figure_formats
    except ImportError:   # no IPython: scripts and CI write PNGs through `path`
        return
    if (shell := get_ipython()) is not None:
        select_figure_formats(shell, {"png"}, bbox_inches="tight")


_show_in_ipython()

MEMORY_KINDS = ("params_bytes", "grads_bytes", "main_params_bytes", "optimizer_states_bytes")
"""The model-state kinds a `memory.MemoryReport` measures, bottom to top of each stacked bar."""
MEMORY_LABELS = ("params", "grads", "main params (fp32)", "optimizer states")
MIB = 2**20


def _save(fig: Figure, path) -> Figure:
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, bbox_inches="tight")
    return fig


def _figure(width: float = 6.4, height: float = 3.6):
    fig = Figure(figsize=(width, height))
    return fig, fig.add_subplot()


def loss_curves(histories: Mapping[str, Sequence[float]], path=None, *, title: str = "training loss",
                ylabel: str = "loss (per token)", events: Mapping[str, int] | None = None) -> Figure:
    """One line per run, e.g. {"DDP": [...], "FSDP": [...]}; loss over optimizer steps (log y).

    Runs that should be identical (DDP vs FSDP from one seed) draw on top of each other, so the
    later ones are dashed: a visible second line means they diverged. `events` marks steps with
    a dotted vertical line, e.g. {"resumed from checkpoint": 150}."""
    fig, ax = _figure()
    for label, step in (events or {}).items():
        ax.axvline(step, color="gray", linestyle=":", label=label)
    for i, (name, values) in enumerate(histories.items()):
        ax.plot(range(1, len(values) + 1), list(values), label=name, linestyle="-" if i == 0 else "--",
                linewidth=2.0 if i == 0 else 1.4)
    if all(v > 0 for values in histories.values() for v in values):
        ax.set_yscale("log")
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _as_dict(report) -> dict:
    return report.as_dict() if hasattr(report, "as_dict") else dict(report)


def memory_breakdown(reports: Mapping[str, object], formula: Mapping[str, int] | None = None, path=None, *,
                     title: str = "model state per rank") -> Figure:
    """Stacked bars (MiB) of params / grads / main params / optimizer states per run.

    reports: run name -> `MemoryReport` or its `as_dict()` (e.g. {"DDP N=2": ..., "FSDP N=2": ...}).
    formula: run name -> bytes the ZeRO formula predicts (`memory.zero_formula_bytes`), drawn as
        a black marker next to the run's bar, so measured and predicted read side by side.
    """
    fig, ax = _figure(max(6.4, 1.6 * len(reports) + 2), 4.2)
    names = list(reports)
    rows = [_as_dict(reports[n]) for n in names]
    bottom = [0.0] * len(names)
    for kind, label in zip(MEMORY_KINDS, MEMORY_LABELS):
        heights = [row.get(kind, 0) / MIB for row in rows]
        ax.bar(range(len(names)), heights, bottom=bottom, width=0.55, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    if formula:
        xs = [i + 0.36 for i, n in enumerate(names) if n in formula]
        ys = [formula[n] / MIB for n in names if n in formula]
        ax.scatter(xs, ys, marker="_", s=600, linewidths=3, color="black", zorder=3, label="ZeRO formula")
    for i, total in enumerate(bottom):
        ax.annotate(f"{total:.2f}", (i, total), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set(ylabel="MiB per rank", title=title)
    ax.grid(axis="y", alpha=0.3)
    top = max(bottom + [v / MIB for v in (formula or {}).values()] + [1e-9])
    ax.set_ylim(0, top * 1.12)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def reward_curve(values: Sequence[float], path=None, *, title: str = "mean reward", window: int = 10) -> Figure:
    """Reward (or accuracy) per step, raw and as a trailing mean over `window` steps."""
    fig, ax = _figure()
    values = list(values)
    steps = range(1, len(values) + 1)
    ax.plot(steps, values, alpha=0.35, label="per step")
    if len(values) >= 2:
        smooth = [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1))
                  for i in range(len(values))]
        ax.plot(steps, smooth, linewidth=2, label=f"mean of last {window}")
    ax.set(xlabel="step", ylabel="reward", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


ITERATION_PARTS = ("sync_s", "rollout_s", "logprob_s", "update_s")
"""The parts of an RL iteration `iteration_time` stacks, as GRPO/DAPO histories name them."""


def iteration_time(history, path=None, *, floors: list[dict] | None = None,
                   title: str = "where an RL iteration's time goes") -> Figure:
    """Seconds per iteration of a GRPO/DAPO history, stacked: weight sync, rollout, old log-probs, update. With
    `floors` (per iteration, {part: seconds the hardware cannot beat}, as bench/grpo_iteration.py computes them) a
    narrow hatched bar beside each one stacks the floors the same way."""
    fig, ax = _figure()
    its = list(range(1, len(history.rollout_s) + 1))
    width = 0.6 if floors is None else 0.45
    xs = its if floors is None else [i - 0.24 for i in its]
    bottom, low = [0.0] * len(its), [0.0] * len(its)
    for n, part in enumerate(ITERATION_PARTS):
        values = getattr(history, part)
        color = f"C{n}"
        ax.bar(xs, values, width=width, bottom=bottom, label=part[:-2], color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
        if floors is not None:
            lows = [f[part] for f in floors]
            ax.bar([i + 0.24 for i in its], lows, width=0.3, bottom=low, color=color, alpha=0.45, hatch="//",
                   label="floor (hatched)" if n == 0 else None)
            low = [b + v for b, v in zip(low, lows)]
    ax.set(xlabel="iteration", ylabel="seconds", title=title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def logprob_mismatch(history, path=None, *, title: str = "rollout vs trainer log-probs") -> Figure:
    """Per iteration, the mean and max |logp_rollout - logp_trainer| over the sampled tokens (`rl.scoring`)."""
    fig, ax = _figure()
    its = range(1, len(history.logprob_diff_mean) + 1)
    ax.plot(its, history.logprob_diff_mean, marker="o", label="mean")
    ax.plot(its, history.logprob_diff_max, marker="o", label="max")
    ax.set(xlabel="iteration", ylabel="|log-prob difference|", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def staleness_histogram(history, path=None, *, title: str = "how old the trained tokens were") -> Figure:
    """Partial rollouts (`rl.partial`): the tokens trained on, by how many policy versions behind the trainer they
    were sampled, summed over the iterations (`History.staleness_tokens`), each bar labelled with its share."""
    fig, ax = _figure()
    width = max(map(len, history.staleness_tokens), default=0)
    counts = [sum(h[k] for h in history.staleness_tokens if k < len(h)) for k in range(width)]
    bars = ax.bar(range(width), counts, width=0.6)
    ax.bar_label(bars, labels=[f"{c / max(sum(counts), 1):.0%}" for c in counts], fontsize=8)
    ax.set_xticks(range(width))
    ax.set(xlabel="versions behind the policy trained", ylabel="tokens", title=title)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def router_replay(results: Mapping[str, Mapping[str, float]], path=None, *,
                  title: str = "MoE router replay") -> Figure:
    """Per setting (e.g. the rollout engine's dtype -> `rl.scoring.routing_mismatch`'s dict): on the left the share
    of (token, MoE layer) pairs the trainer's router sends to other experts than the rollout did; on the right the
    mean and max |log-prob difference| without replay and with it."""
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    flips, drift = fig.subplots(1, 2)
    names = list(results)
    bars = flips.bar(names, [100 * results[n]["flips"] for n in names], width=0.5, color="C3")
    flips.bar_label(bars, fmt="%.2f%%", fontsize=8)
    flips.set(ylabel="% of (token, layer) routed elsewhere", title="routing flips (no replay)")
    for i, (stat, replay) in enumerate((s, r) for s in ("mean", "max") for r in ("without", "with")):
        drift.bar([j + (i - 1.5) * 0.2 for j in range(len(names))], [results[n][f"diff_{stat}_{replay}"] for n in names],
                  width=0.2, color=f"C{i // 2}", alpha=1.0 if replay == "without" else 0.5,
                  hatch=None if replay == "without" else "//", label=f"{stat}, {replay} replay")
    drift.set_xticks(range(len(names)), names)
    drift.set(ylabel="|log-prob difference|", title="rollout vs trainer log-probs")
    drift.legend(fontsize=8)
    for ax in (flips, drift):
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    return _save(fig, path)

TIMELINE_COLORS = dict(compute="tab:green", all_gather="tab:blue", reduce_scatter="tab:orange",
                       all_reduce="tab:purple", other_comm="tab:gray", wait="tab:brown")


def step_timeline(events_by_rank: Mapping[str, Sequence], path=None, *, title: str = "one step per rank") -> Figure:
    """One axis per rank (label -> that rank's `perf.profile.Event`s of ONE step), time in ms.

    A row per kind present: compute, then each collective. A collective's transfer (gloo's worker
    thread, or an NCCL kernel's stream) fills the row; the training thread's call to it is the
    thin dark bar under it. The top row and the red shading are the exposed communication
    (`perf.profile.exposed_intervals`): communication while no compute runs."""
    from ..perf.profile import KINDS, exposed_intervals
    from ..perf.timeline import union
    kinds = [k for k in KINDS if any(e.kind == k for evs in events_by_rank.values() for e in evs)]
    rows = kinds + ["exposed"]
    fig = Figure(figsize=(11, 0.45 * len(rows) * len(events_by_rank) + 1.2))
    axes = fig.subplots(len(events_by_rank), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (label, events) in zip(axes, events_by_rank.items()):
        exposed = exposed_intervals(events)
        for y, kind in enumerate(rows):
            if kind == "exposed":
                spans, color = exposed, "red"
            else:
                spans, color = union((e.start_s, e.end_s) for e in events if e.kind == kind and e.lane != "main"
                                     or e.kind == kind == "compute"), TIMELINE_COLORS[kind]
                calls = union((e.start_s, e.end_s) for e in events if e.kind == kind != "compute" and e.lane == "main")
                ax.broken_barh([(s * 1e3, max((e - s) * 1e3, 0.02)) for s, e in calls], (y - 0.4, 0.2), color="black")
            ax.broken_barh([(s * 1e3, max((e - s) * 1e3, 0.02)) for s, e in spans], (y - 0.15, 0.55), color=color)
        for s, e in exposed:
            ax.axvspan(s * 1e3, e * 1e3, color="red", alpha=0.12, linewidth=0)
        ax.set_yticks(range(len(rows)), [r.replace("_", "-") for r in rows], fontsize=8)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.invert_yaxis()
        ax.set_ylabel(label)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_title(title)
    axes[-1].set_xlabel("ms from the step's start")
    return _save(fig, path)
