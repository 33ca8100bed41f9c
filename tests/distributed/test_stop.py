"""Stop as a pause, in one process: SIGINT inside a `stoppable` block only raises the flag, a second one is Python's
KeyboardInterrupt, outside the block (or on a process that never armed it) nothing changes. The cross-rank agreement
and the bitwise continuation run on real engines in tests/notebook/test_stop.py."""
import os
import signal

import pytest

from mfsdp_kit.distributed import stop


@pytest.fixture
def armed():
    stop.enable()   # no process group: agreed() is this rank's own flag
    yield
    stop.disable()


def _sigint():
    os.kill(os.getpid(), signal.SIGINT)


def test_a_first_sigint_raises_the_flag_and_a_second_interrupts(armed):
    with stop.stoppable():
        assert not stop.agreed()
        _sigint()
        assert stop.requested() and stop.agreed()
        with pytest.raises(KeyboardInterrupt):
            _sigint()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # the handler before it is back


def test_nested_blocks_share_the_outer_handler_and_record_is_taken_once(armed):
    with stop.stoppable():
        with stop.stoppable():
            _sigint()
        assert stop.requested()   # the inner block ending clears nothing: the outer loop stops at its boundary
        got = stop.record(what="train.fit", step=3, total=10, resume="fit(..., start_step=3, steps=7)")
    assert got.line() == ("train.fit: stopped at step 3 of 10 on every rank (History kept; "
                          "fit(..., start_step=3, steps=7) continues)")
    assert stop.take() == dict(what="train.fit", step=3, total=10, resume="fit(..., start_step=3, steps=7)")
    assert stop.take() is None and not stop.requested()


def test_unarmed_processes_keep_pythons_interrupt():
    assert not stop.enabled()
    with stop.stoppable():
        with pytest.raises(KeyboardInterrupt):
            _sigint()
        assert not stop.agreed()


def test_outside_a_block_sigint_is_keyboard_interrupt(armed):
    with pytest.raises(KeyboardInterrupt):
        _sigint()
    assert not stop.requested()


def test_work_without_a_boundary_finishes_then_interrupts(armed):
    done = []
    with pytest.raises(KeyboardInterrupt, match="Stop came during a checkpoint save, which finished first"):
        with stop.stoppable(then_interrupt="a checkpoint save"):
            _sigint()
            done.append("saved")   # the work goes on to its end
    assert done == ["saved"] and not stop.requested()
    with stop.stoppable():   # inside a loop it only leaves the flag, for the loop's next boundary
        with stop.stoppable(then_interrupt="a rollout"):
            _sigint()
        assert stop.requested()
