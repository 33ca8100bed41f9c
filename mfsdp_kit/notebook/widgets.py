"""ipywidgets for the notebooks: an `EngineConfig` form that validates as you type, and a live
training panel (loss curve, tokens/s and memory per rank).

`config_form()` builds the config with `EngineConfig(...).validate(on_gpu=False)` on every
change, so a bad value (tensor_model_parallel_size=0, FSDP without the distributed optimizer,
an unknown override key) shows `ConfigError`'s own text in red right under the fields, long
before an engine starts. `.value` is always the last VALID config.

`TrainingPanel` draws the loss as an inline SVG sparkline (no matplotlib redraw per step) and a
table of the latest step, loss, tokens/s and memory per rank. Feed it
- on the client: `fit(..., on_step=panel.on_step)` or `panel.update_history(history)`;
- from engines: `cluster.run_with_panel(handle, panel, fn)` polls what each rank publishes with
  `cluster.report` (fit reports step/loss/tokens_per_s; pass `on_step=widgets.StepReporter()` to
  add memory_bytes and every step's loss).
Without a notebook front end it only keeps the numbers (`.loss`, `.last`, `.text()`).
"""
from __future__ import annotations

import dataclasses
import html
import json
from typing import Any

from ..config import ATTENTION_BACKENDS, DTYPES, RECOMPUTE, ConfigError, EngineConfig
from ..config.flat import flat_values, leaf_fields, nest
from ..lora import LoRAConfig

FIELDS = leaf_fields(EngineConfig)
"""Every value field of EngineConfig and its sections, by its flat name (unique across sections): one widget each."""
BOOL_FIELDS = tuple(name for name, (_, _, default) in FIELDS.items() if isinstance(default, bool))
"""Every on/off switch of EngineConfig, found from its defaults (so a new switch gets a checkbox)."""
INT_FIELDS = tuple(name for name, (_, _, default) in FIELDS.items()
                   if isinstance(default, int) and name not in BOOL_FIELDS)
"""Every integer field (parallel sizes, seed), found the same way: a new size is never a text box."""
OPTIONAL_INT_FIELDS = tuple(name for name, (_, hint, default) in FIELDS.items()
                            if default is None and hint == (int | None))
"""Integer-or-None fields (virtual_pipeline_model_parallel_size, nccl_max_ctas): a text box where "" means None."""
CHOICE_FIELDS = {"dtype": DTYPES, "attention_backend": ATTENTION_BACKENDS, "recompute": RECOMPUTE}
DICT_FIELDS = ("override_ddp_config", "override_transformer_config")
"""Edited as JSON text, e.g. {"data_parallel_sharding_strategy": "optim_grads"}."""
SECTION_FIELDS = {"lora": LoRAConfig}
"""Config sections, edited as JSON text of their fields, e.g. {"rank": 8}; "" means None."""
ERROR_STYLE = "color:#c62828;font-family:monospace;white-space:pre-wrap"


# ---- config form ---------------------------------------------------------------------------------
def _field_widget(name: str, value: Any):
    import ipywidgets as w
    style, layout = {"description_width": "230px"}, w.Layout(width="420px")
    if name in INT_FIELDS:   # IntText, not BoundedIntText: a bad value must reach validate()
        return w.IntText(value=value, description=name, style=style, layout=layout)
    if name in BOOL_FIELDS:
        return w.Checkbox(value=value, description=name, style=style, layout=layout, indent=False)
    if name in CHOICE_FIELDS:
        return w.Dropdown(options=CHOICE_FIELDS[name], value=value, description=name, style=style, layout=layout)
    if name in SECTION_FIELDS:
        value = "" if value is None else json.dumps(dataclasses.asdict(value))
        return w.Text(value=value, description=name, style=style, layout=w.Layout(width="620px"), placeholder="None")
    if name in DICT_FIELDS:
        return w.Text(value=json.dumps(value), description=name, style=style, layout=w.Layout(width="620px"))
    # OPTIONAL_INT_FIELDS: "" means None
    return w.Text(value="" if value is None else str(value), description=name, style=style, layout=layout,
                  placeholder="None")


def _parse(name: str, raw: Any) -> Any:
    if name in SECTION_FIELDS:
        return _section(name, raw)
    if name in DICT_FIELDS:
        try:
            return json.loads(raw or "{}")
        except json.JSONDecodeError as e:
            raise ConfigError(f"{name}={raw!r} is not allowed; allowed: a JSON object ({e.msg})") from None
    if name in OPTIONAL_INT_FIELDS:
        text = str(raw).strip()
        if text in ("", "None"):
            return None
        if not text.lstrip("-").isdigit():
            raise ConfigError(f"{name}={text!r} is not allowed; allowed: None or an integer")
        return int(text)
    return raw


def _section(name: str, raw: Any) -> Any:
    """None for "" (or "None"), else the section's dataclass made from a JSON object of its fields."""
    text = str(raw).strip()
    if text in ("", "None", "null"):
        return None
    cls = SECTION_FIELDS[name]
    allowed = f'"" (None) or a JSON object of {[f.name for f in dataclasses.fields(cls)]}'
    try:
        fields = json.loads(text)
        return cls(**fields)
    except (json.JSONDecodeError, TypeError):
        raise ConfigError(f"{name}={text!r} is not allowed; allowed: {allowed}") from None


class ConfigForm:
    """Widgets for every `EngineConfig` field; `.value` is the last valid config, `.error` the
    current problem (None when the fields form a valid config). Displays as its `.widget`."""

    def __init__(self, initial: EngineConfig | None = None):
        import ipywidgets as w
        initial = initial or EngineConfig()
        self.fields = {name: _field_widget(name, value) for name, value in flat_values(initial).items()}
        self.status = w.HTML()
        self.widget = w.VBox([*self.fields.values(), self.status])
        self.value: EngineConfig = initial
        self.error: str | None = None
        for f in self.fields.values():
            f.observe(self._changed, names="value")
        self.validate()

    def validate(self) -> str | None:
        """Build and validate the config from the fields; show the result; return the error text."""
        try:
            cfg = EngineConfig(**nest({n: _parse(n, f.value) for n, f in self.fields.items()}))
            cfg.validate(on_gpu=False)
        except ConfigError as e:
            self.error = str(e)
            self.status.value = f'<span style="{ERROR_STYLE}">ConfigError: {html.escape(self.error)}</span>'
            return self.error
        self.value, self.error = cfg, None
        self.status.value = '<span style="color:#2e7d32">valid</span>'
        return None

    def _changed(self, _change) -> None:
        self.validate()

    def set(self, **values: Any) -> "ConfigForm":
        """Set fields programmatically (as a user typing would); each one validates."""
        for name, value in values.items():
            if name not in self.fields:
                raise ConfigError(f"{name!r} is not allowed; allowed: the fields {list(self.fields)}")
            if name in DICT_FIELDS and isinstance(value, dict):
                value = json.dumps(value)
            if name in SECTION_FIELDS and not isinstance(value, str):
                value = "" if value is None else json.dumps(dataclasses.asdict(value))
            self.fields[name].value = value
        return self

    def html(self) -> str:
        """A static snapshot: field = value rows and the status line (renders without widget JS)."""
        rows = "".join(f'<tr><td style="padding:1px 10px">{n}</td><td style="padding:1px 10px">'
                       f"{html.escape(str(f.value))}</td></tr>" for n, f in self.fields.items())
        return f'<table style="font-family:monospace;font-size:12px">{rows}</table>{self.status.value}'

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.widget)


def config_form(initial: EngineConfig | None = None) -> ConfigForm:
    """An editable, self-validating form for an `EngineConfig` (display it as a cell's value)."""
    return ConfigForm(initial)


# ---- training panel ------------------------------------------------------------------------------
def _fmt_bytes(n: float | None) -> str:
    if not n:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def sparkline_svg(values: list[float], *, width: int = 520, height: int = 140, log: bool = True) -> str:
    """An SVG polyline of `values` (log scale when all are positive), with min/max labels."""
    import math
    if not values:
        return f'<svg width="{width}" height="{height}"></svg>'
    use_log = log and all(v > 0 for v in values)
    ys = [math.log10(v) if use_log else v for v in values]
    lo, hi = min(ys), max(ys)
    span = (hi - lo) or 1.0
    pad = 18
    n = max(len(ys) - 1, 1)
    points = " ".join(f"{pad + i * (width - 2 * pad) / n:.1f},{pad + (hi - y) * (height - 2 * pad) / span:.1f}"
                      for i, y in enumerate(ys))
    return (f'<svg width="{width}" height="{height}" style="background:#fafafa;border:1px solid #ddd">'
            f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{points}"/>'
            f'<text x="4" y="12" font-size="10">{max(values):.4g}</text>'
            f'<text x="4" y="{height - 4}" font-size="10">{min(values):.4g}</text>'
            f'<text x="{width - 4}" y="{height - 4}" font-size="10" text-anchor="end">step {len(values)}</text>'
            "</svg>")


class TrainingPanel:
    """Live loss curve plus the latest step / loss / tokens/s / memory of each rank."""

    def __init__(self, ranks: list[int] | None = None, *, title: str = "training", show: bool = True):
        self.ranks = list(ranks) if ranks is not None else [0]
        self.title = title
        self.loss: list[float] = []
        """Loss per step (the global mean: every rank reports the same value, rank order wins)."""
        self.last: dict[int, dict] = {}
        self._steps_seen: set[int] = set()
        self.widget = None
        try:
            import ipywidgets as w
            from IPython import get_ipython
        except ImportError:
            return
        self.widget = w.HTML(value=self.html())
        if show and get_ipython() is not None:
            from IPython.display import display
            display(self.widget)

    # -- feeding -----------------------------------------------------------------------------------
    def update(self, data_by_rank: dict[int, dict]) -> None:
        """Per-rank dicts as `cluster.report` publishes them (step, total, loss, tokens_per_s, ...)."""
        for rank, data in data_by_rank.items():
            if not data:
                continue
            fresh = {k: v for k, v in data.items() if v is not None and k != "loss_curve"}   # report(total=None) keeps the old
            self.last[rank] = {**self.last.get(rank, {}), **fresh}
            step = data.get("step")
            if "loss_curve" in data:   # a StepReporter sent every step so far
                self.loss = list(data["loss_curve"])
                self._steps_seen = set(range(1, len(self.loss) + 1))
            elif step is not None and step not in self._steps_seen and "loss" in data:
                self._steps_seen.add(step)
                self.loss.append(float(data["loss"]))
        self.refresh()

    def on_step(self, step: int, result, *, rank: int = 0, total: int | None = None) -> None:
        """`fit(..., on_step=panel.on_step)` on the client: a `train.StepResult` per step."""
        import torch
        memory = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else _rss_bytes()
        self.update({rank: dict(step=step + 1, total=total, loss=result.loss,
                                tokens_per_s=result.tokens / max(result.step_time_s, 1e-9), memory_bytes=memory)})

    def update_history(self, history, *, rank: int = 0) -> None:
        """A whole `train.History` at once (e.g. after `fit` returned)."""
        for i, loss in enumerate(history.loss):
            self.update({rank: dict(step=i + 1, total=len(history.loss), loss=loss,
                                    tokens_per_s=history.tokens_per_s[i],
                                    memory_bytes=history.memory_bytes[i] or None)})

    # -- drawing -----------------------------------------------------------------------------------
    def text(self, rank: int) -> str:
        d = self.last.get(rank, {})
        loss = f"{d['loss']:.4f}" if "loss" in d else "-"
        tps = f"{d['tokens_per_s']:.0f}" if d.get("tokens_per_s") else "-"
        return (f"rank {rank}: step {d.get('step', '-')}/{d.get('total') or '?'} loss {loss} "
                f"tokens/s {tps} memory {_fmt_bytes(d.get('memory_bytes'))}")

    def html(self) -> str:
        rows = ""
        for r in self.ranks:
            d = self.last.get(r, {})
            cells = [str(r), f"{d.get('step', '-')}/{d.get('total') or '?'}",
                     f"{d['loss']:.4f}" if "loss" in d else "-",
                     f"{d['tokens_per_s']:.0f}" if d.get("tokens_per_s") else "-", _fmt_bytes(d.get("memory_bytes"))]
            rows += "<tr>" + "".join(f'<td style="padding:2px 10px">{c}</td>' for c in cells) + "</tr>"
        head = "".join(f'<th style="padding:2px 10px">{h}</th>' for h in ("rank", "step", "loss", "tokens/s", "memory"))
        return (f"<div><b>{html.escape(self.title)}</b> &mdash; loss per step<br>{sparkline_svg(self.loss)}"
                f'<table style="font-family:monospace;font-size:12px"><tr>{head}</tr>{rows}</table></div>')

    def refresh(self) -> None:
        if self.widget is not None:
            self.widget.value = self.html()

    def _repr_html_(self) -> str:   # a static snapshot (renders in exported HTML without widget JS)
        return self.html()


# ---- engine side -----------------------------------------------------------------------------------
def _rss_bytes() -> int:
    import psutil
    return psutil.Process().memory_info().rss


class StepReporter:
    """`fit(..., on_step=widgets.StepReporter())` on engines: publish this rank's memory (peak
    CUDA allocated on GPU, process RSS on CPU) and the loss curve so far next to what `fit`
    reports, so a panel polled every 0.25 s still draws every step."""

    def __init__(self, *, total: int | None = None, max_points: int = 2000):
        self.total, self.max_points = total, max_points
        self.losses: list[float] = []

    def __call__(self, step: int, result) -> None:
        import torch

        from .progress import report
        self.losses.append(float(result.loss))
        memory = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else _rss_bytes()
        report(step=step + 1, total=self.total, memory_bytes=memory, loss_curve=self.losses[-self.max_points:])
