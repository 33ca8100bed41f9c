"""Training health: a dead model (lr 1e6) warns once naming the step; a NaN loss_mask stops naming the step.

The 2-rank runs use the embedded tiny model under Megatron-FSDP on gloo; the HealthWatch rows feed it
step results directly to pin each rule down."""
import math
import warnings

import pytest

from mfsdp_kit.train import DeadModelWarning, HealthWatch, StepResult
from tests.dist import launch


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three 2-rank runs in one job, one after another (each inits and shuts down its own layout)."""
    workdir = str(tmp_path_factory.mktemp("health"))
    calls = [["scenarios_health:dead_model", dict(workdir=workdir, lr=1e6)],
             ["scenarios_health:dead_model", dict(workdir=workdir, lr=3e-3, steps=6)],
             ["scenarios_health:nan_loss_mask", dict(workdir=workdir, bad_step=2)]]
    return dict(zip(["dead", "healthy", "nan"], launch.run("sequence", calls=calls)))


def test_lr_1e6_kills_the_model_and_fit_warns_once_naming_the_step(runs):
    r = runs["dead"]
    assert r["grad_norm"][0] > 0 and r["grad_norm"][1:] == [0.0] * 7, r          # what the issue saw
    assert all(math.isclose(loss, r["ln_vocab"], rel_tol=1e-3) for loss in r["loss"][1:]), r
    assert len(r["warnings"]) == 1 and r["warnings"][0].startswith("step 1: gradient norm is exactly 0.0"), r


def test_healthy_run_does_not_warn(runs):
    r = runs["healthy"]
    assert r["warnings"] == [] and r["loss"][-1] < r["loss"][0] - 0.5, r


def test_nan_in_loss_mask_stops_fit_naming_step_and_field(runs):
    r = runs["nan"]
    assert r["error"].startswith("step 2: loss_mask holds 1 non-finite"), r
    assert {"NonFiniteLossError", "ValueError"} <= set(r["error_type"]), r


def _feed(watch, rows, *, everything: bool = False):
    """Rows (loss, grad norm[, loss tokens]) into the watch; the DeadModelWarnings (`everything`: all warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (loss, grad_norm, *tokens) in enumerate(rows):
            watch(i, StepResult(loss=loss, grad_norm=grad_norm, tokens=tokens[0] if tokens else 1, lr=1e-3,
                                step_time_s=1.0))
    return [str(w.message) for w in caught if everything or issubclass(w.category, DeadModelWarning)]


@pytest.mark.parametrize("rows,first_words", [
    ([(4.0, 1.0), (3.0, 0.0), (3.0, 0.0)], "step 1: gradient norm is exactly 0.0"),      # once, at the first zero
    ([(math.log(128), 1.0)] * 6, "step 4: loss 4.8520 has equalled ln(vocab)"),          # the 5th uniform step
    ([(math.log(128) * 1.0005, 1.0)] * 5, "step 4: loss"),                               # within 1e-3 relative
    ([(3.0, 0.0)] * 6, None),                                                            # clip_grad=0 reports 0.0
    ([(math.log(128), 1.0)] * 4 + [(3.0, 1.0)] + [(math.log(128), 1.0)] * 4, None),     # not 5 in a row
    ([(math.log(128) * 1.01, 1.0)] * 6, None)])                                          # 1 % off: learning
def test_health_watch_rules(rows, first_words):
    caught = _feed(HealthWatch(vocab_size=128), rows)
    assert (caught == []) if first_words is None else (len(caught) == 1 and caught[0].startswith(first_words)), caught


def test_a_step_without_loss_tokens_is_skipped_and_said():
    """Issue 36 case 7: an all-zero loss_mask reports loss 0.0, grad norm 0.0; that is no dead model."""
    caught = _feed(HealthWatch(vocab_size=128), [(4.0, 1.0), (0.0, 0.0, 0), (3.9, 1.0)], everything=True)
    assert caught == ["step 1: the global batch has no loss tokens (its loss_mask is all 0), so its loss 0.0 and "
                      "grad norm 0.0 say nothing; the dead-model watch skips it"], caught


def test_a_step_the_loss_scaler_skipped_says_nothing_of_the_grad_norm():
    """fp16's first steps may be skipped (scaled gradients overflowed: grad norm NaN). With clip_grad=0 the grad norms
    after it are 0.0 from the start, which is no dead model: the skipped step is not a "non-zero" norm."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch = HealthWatch(vocab_size=128)
        watch(0, StepResult(loss=4.0, grad_norm=math.nan, tokens=8, lr=1e-3, step_time_s=1.0, skipped=True))
        for i in (1, 2):
            watch(i, StepResult(loss=4.0, grad_norm=0.0, tokens=8, lr=1e-3, step_time_s=1.0))
    assert not [w for w in caught if issubclass(w.category, DeadModelWarning)]


def test_the_watch_warns_again_after_a_recovery():
    """One warning per episode, not per run: a collapse after a recovery is reported too."""
    rows = [(4.0, 1.0), (3.0, 0.0), (3.0, 0.0), (3.0, 1.0), (3.0, 0.0), (3.0, 0.0)]
    caught = _feed(HealthWatch(vocab_size=128), rows)
    assert [c.split(":")[0] for c in caught] == ["step 1", "step 4"], caught


def test_step_loops_get_the_watch(monkeypatch):
    """`train.step(..., watch=HealthWatch(...))` outside `fit` (the step's work replaced by its results here)."""
    from mfsdp_kit import train
    results = iter([StepResult(loss=4.0, grad_norm=1.0, tokens=8, lr=1e6, step_time_s=1.0),
                    StepResult(loss=math.log(128), grad_norm=0.0, tokens=8, lr=1e6, step_time_s=1.0)])

    class Pending:
        def result(self):
            return next(results)
    monkeypatch.setattr(train, "start_step", lambda *a, **kw: Pending())
    watch = HealthWatch(vocab_size=128)
    with pytest.warns(DeadModelWarning, match="step 1: gradient norm is exactly 0.0"):
        for i in range(2):
            train.step([], None, None, micro_batch_size=1, step_index=i, watch=watch)
