"""mfsdp_kit.perf.capacity: the line fit, the prediction, the next size, and the whole search driven
by a fake device memory (no GPU: a trial is a function of the layer count)."""
from dataclasses import replace

import pytest

from mfsdp_kit.models.gpt import SPECS
from mfsdp_kit.perf.capacity import best_under, fit_line, next_layers, params_ratio, predict_layers, search


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
    """Peak reserved = fixed + per_layer * L; a trial OOMs above `cap` (the slope at size may differ
    from the calibration's: `true_per_layer`)."""

    def __init__(self, *, fixed, per_layer, cap, true_per_layer=None):
        self.fixed, self.cap, self.calib_per_layer = fixed, cap, per_layer
        self.per_layer = true_per_layer or per_layer
        self.calls = []

    def trial(self, layers, purpose):
        slope = self.calib_per_layer if purpose == "calibrate" else self.per_layer
        peak = self.fixed + slope * layers
        self.calls.append(layers)
        ok = peak <= self.cap
        return dict(layers=layers, trained=ok, oom=not ok, error=None if ok else "OOM", peak_reserved_bytes=peak)

    def search(self, **kw):
        settings = dict(calib_layers=[8, 16], layer_step=2, max_trials=4, cap_bytes=lambda: self.cap)
        return search(self.trial, SPECS["7b"], **{**settings, **kw})


def test_search_confirms_an_exact_prediction():
    dev = FakeDevice(fixed=10, per_layer=3, cap=100)
    s = dev.search()
    assert dev.calls == [8, 16, 30, 32]
    assert s["predicted_layers"] == 30 and s["largest_trained_layers"] == 30 and s["smallest_oom_layers"] == 32
    assert s["bracketed"] and s["largest_trained_params"] == replace(SPECS["7b"], num_layers=30).param_count()


def test_search_steps_down_when_the_prediction_is_optimistic():
    # calibration says 3/layer (predicts 30); at size the true slope is 3.3 -> 27 fits
    dev = FakeDevice(fixed=10, per_layer=3, cap=100, true_per_layer=3.3)
    s = dev.search()
    assert dev.calls == [8, 16, 30, 28, 26]
    assert s["largest_trained_layers"] == 26 and s["smallest_oom_layers"] == 28 and s["bracketed"]


def test_search_stops_after_max_trials():
    dev = FakeDevice(fixed=10, per_layer=3, cap=100, true_per_layer=2)  # 45 fit really
    s = dev.search(max_trials=3)
    assert dev.calls == [8, 16, 30, 32, 34]
    assert s["largest_trained_layers"] == 34 and s["smallest_oom_layers"] is None and not s["bracketed"]


def test_search_without_device_memory_trains_larger_sizes():
    dev = FakeDevice(fixed=0, per_layer=1, cap=1e9)
    s = dev.search(calib_layers=[2, 4], max_trials=2, cap_bytes=None)
    assert dev.calls == [2, 4, 6, 8] and s["largest_trained_layers"] == 8 and "predicted_layers" not in s


def test_search_stops_when_a_calibration_size_fails():
    dev = FakeDevice(fixed=10, per_layer=3, cap=40)  # 16 layers = 58 > 40
    assert dev.search() == dict(error="a calibration size did not train") and dev.calls == [8, 16]


def test_ratio():
    assert params_ratio({"fsdp": {"largest_trained_params": 12}, "ddp": {"largest_trained_params": 10}}) \
        == pytest.approx(1.2)
    assert params_ratio({"fsdp": {"largest_trained_params": 12}, "ddp": {"error": "x"}}) is None


# ---- tokens/s under a memory cap (bench/memory_cap.py) ----
def row(system, tokens, peak, mb=8, recompute="none"):
    return dict(system=system, tokens_per_s_per_gpu=tokens, peak_gib=peak, micro_batch_size=mb, recompute=recompute)


def test_best_under_a_cap():
    rows = [row("fsdp", 56e3, 72.5, mb=16), row("fsdp", 53e3, 42.0), row("fsdp", 41e3, 16.1, recompute="full"),
            row("fsdp2", 57e3, 69.1, mb=16), row("ddp", 56e3, 43.3)]
    at40, at80 = best_under(rows, 40), best_under(rows, 80)
    assert at40["fsdp"]["recompute"] == "full" and at40["fsdp2"] is None and at40["ddp"] is None
    assert at80["fsdp"]["micro_batch_size"] == 16 and at80["fsdp2"]["tokens_per_s_per_gpu"] == 57e3
    assert best_under(rows, 42.0)["fsdp"]["peak_gib"] == 42.0   # at the cap counts
