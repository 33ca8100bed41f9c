"""bench/max_model.py's pure parts and its search, driven by a fake device memory."""
import argparse

import pytest
import torch

from bench import max_model
from bench.max_model import fit_line, next_layers, predict_layers
from bench.throughput import SPECS


def test_fit_line():
    assert fit_line([(8, 30), (16, 50)]) == (10, 2.5)
    fixed, per_layer = fit_line([(0, 1.0), (1, 3.0), (2, 5.0)])
    assert fixed == pytest.approx(1.0) and per_layer == pytest.approx(2.0)
    with pytest.raises(ValueError, match="two distinct"):
        fit_line([(8, 30), (8, 31)])


def test_predict_layers():
    assert predict_layers(100, 10, 3) == 30  # 10 + 3 * 30 = 100 fits
    assert predict_layers(99.9, 10, 3) == 29
    assert predict_layers(5, 10, 3, min_layers=2) == 2
    with pytest.raises(ValueError):
        predict_layers(100, 10, 0)


def test_next_layers():
    assert next_layers([(30, True)], step=2) == 32
    assert next_layers([(30, False)], step=2) == 28
    assert next_layers([(8, True), (30, False)], step=2) == 28
    assert next_layers([(30, True), (32, False)], step=2) is None  # bracketed
    assert next_layers([(30, False), (28, True)], step=2) is None
    assert next_layers([(31, False), (29, True)], step=4) is None
    assert next_layers([(30, True), (33, False)], step=2) == 31  # +2 would leave the bracket
    assert next_layers([(2, False)], step=2, min_layers=1) is None


class FakeDevice:
    """Peak reserved = fixed + per_layer * L; a trial OOMs above `cap` (real slope may differ)."""

    def __init__(self, monkeypatch, *, fixed, per_layer, cap, true_per_layer=None):
        self.fixed, self.cap, self.per_layer = fixed, cap, true_per_layer or per_layer
        self.calls = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(max_model, "set_cap", lambda margin: dict(cap_bytes=cap))
        monkeypatch.setattr(max_model, "trial", self.trial)
        self.calib_per_layer = per_layer

    def trial(self, mode, spec, args, *, purpose):
        n = spec.num_layers
        slope = self.calib_per_layer if purpose == "calibrate" else self.per_layer
        peak = self.fixed + slope * n
        self.calls.append(n)
        ok = peak <= self.cap
        return dict(layers=n, trained=ok, oom=not ok, error=None if ok else "OOM", peak_reserved_bytes=peak)


def _args(**kw):
    return argparse.Namespace(**{**dict(calib_layers=[8, 16], layer_step=2, max_trials=4, margin_gib=2.0), **kw})


def test_search_confirms_an_exact_prediction(monkeypatch):
    dev = FakeDevice(monkeypatch, fixed=10, per_layer=3, cap=100)
    recorded = []
    s = max_model.search_mode("fsdp", SPECS["7b"], _args(), {}, recorded.append)
    assert dev.calls == [8, 16, 30, 32] and len(recorded) == 4
    assert s["predicted_layers"] == 30 and s["largest_trained_layers"] == 30 and s["smallest_oom_layers"] == 32
    assert s["bracketed"] and s["largest_trained_params"] == max_model.replace(SPECS["7b"], num_layers=30).param_count()


def test_search_steps_down_when_the_prediction_is_optimistic(monkeypatch):
    # calibration says 3/layer (predicts 30); at size the true slope is 3.3 -> 27 fits
    dev = FakeDevice(monkeypatch, fixed=10, per_layer=3, cap=100, true_per_layer=3.3)
    s = max_model.search_mode("ddp", SPECS["7b"], _args(), {}, lambda t: None)
    assert dev.calls == [8, 16, 30, 28, 26]
    assert s["largest_trained_layers"] == 26 and s["smallest_oom_layers"] == 28 and s["bracketed"]


def test_search_stops_after_max_trials(monkeypatch):
    dev = FakeDevice(monkeypatch, fixed=10, per_layer=3, cap=100, true_per_layer=2)  # 45 fit really
    s = max_model.search_mode("fsdp", SPECS["7b"], _args(max_trials=3), {}, lambda t: None)
    assert dev.calls == [8, 16, 30, 32, 34]
    assert s["largest_trained_layers"] == 34 and s["smallest_oom_layers"] is None and not s["bracketed"]


def test_ratio():
    assert max_model.summary_ratio({"fsdp": {"largest_trained_params": 12}, "ddp": {"largest_trained_params": 10}}) \
        == pytest.approx(1.2)
    assert max_model.summary_ratio({"fsdp": {"largest_trained_params": 12}, "ddp": {"error": "x"}}) is None
