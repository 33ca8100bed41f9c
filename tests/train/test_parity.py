"""mfsdp_kit.train.parity on hand-computed curves: the tight phase, the statistical phase, and failures."""
import pytest

from mfsdp_kit.train.parity import compare_curves, relative_differences

pytestmark = pytest.mark.parity


def test_relative_differences_by_hand():
    assert relative_differences([2.0, 0.0, -4.0], [1.0, 0.0, -3.0]) == [0.5, 0.0, 0.25]


def test_reduction_order_differences_pass_and_report_the_worst_step():
    ref = [4.0, 3.0, 2.0]
    cand = [4.0, 3.0 * (1 + 2e-7), 2.0]
    report = compare_curves(ref, cand, exact_steps=3, reference_grad_norm=[1.0, 1.0, 1.0],
                            candidate_grad_norm=[1.0, 1.0, 1.0 + 5e-7])
    assert report.worst_exact_step == 2 and report.worst_exact == pytest.approx(5e-7 / (1 + 5e-7))
    assert report.ok and report.exact_margin == pytest.approx(20, rel=1e-3)
    report.check()


def test_a_wrong_step_fails_even_when_the_rest_agree():
    ref = [4.0, 3.0, 2.0, 1.0]
    report = compare_curves(ref, [4.0, 3.0, 2.001, 1.0], exact_steps=4)
    assert not report.ok and report.worst_exact_step == 2
    with pytest.raises(AssertionError, match="first 4 steps"):
        report.check()


def test_grad_norm_is_compared_too():
    report = compare_curves([1.0, 1.0], [1.0, 1.0], exact_steps=2, reference_grad_norm=[2.0, 2.0],
                            candidate_grad_norm=[2.0, 4.0])  # same loss, gradient scaled by 2 at step 1
    assert report.worst_exact == 0.5 and not report.ok


def test_late_window_median_gap_against_the_spread():
    # window a: 1..8 (median 4.5, quartiles 2.25 / 6.75 -> IQR 4.5); window b: 3..10 (median 6.5, IQR 4.5)
    a, b = [9.0] + [float(x) for x in range(1, 9)], [9.0] + [float(x) for x in range(3, 11)]
    report = compare_curves(a, b, exact_steps=1, late_window=8, noise_multiple=1.0)
    assert report.late_gap == 2.0 and report.late_tolerance == 4.5 and report.ok
    tight = compare_curves(a, b, exact_steps=1, late_window=8, noise_multiple=0.25)  # 1.125 allowed
    with pytest.raises(AssertionError, match="different loss levels"):
        tight.check()


def test_a_run_that_stops_learning_fails_the_late_check():
    learning = [5.0 / (1 + i) + 0.01 * (i % 3) for i in range(60)]
    stuck = learning[:10] + [learning[9] + 0.01 * (i % 3) for i in range(50)]
    report = compare_curves(learning, stuck, exact_steps=10, late_window=30)
    assert report.worst_exact == 0.0 and not report.ok


@pytest.mark.parametrize("kwargs, field", [(dict(exact_steps=0), "exact_steps"),
                                           (dict(exact_steps=5), "exact_steps"),
                                           (dict(exact_steps=2, late_window=2), "late_window")])
def test_bad_windows_name_the_argument(kwargs, field):
    with pytest.raises(ValueError, match=field):
        compare_curves([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0], **kwargs)
    with pytest.raises(ValueError, match="same length"):
        compare_curves([1.0], [1.0, 2.0])
