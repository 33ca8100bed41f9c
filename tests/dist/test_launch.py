"""tests/dist/launch.py: what torchrun gave each job, the forked ranks give too (fresh processes, the
first failure stops the others and names its rank with the traceback, a timeout ends a hung job)."""
import pytest

from tests.dist import launch


def test_each_call_gets_fresh_processes():
    first, second = launch.run("pids"), launch.run("pids")
    assert len(set(first["pids"])) == 2 and not set(first["pids"]) & set(second["pids"])
    assert not first["ran_before"] and not second["ran_before"]


@pytest.mark.parametrize("torchrun", [False, True], ids=["forked", "torchrun"])
def test_a_failing_rank_fails_the_call_with_its_traceback(torchrun):
    """Rank 1 raises while rank 0 waits in a barrier: the call fails at once, not at the timeout."""
    with pytest.raises(AssertionError) as e:
        launch.run("fail_on", rank=1, timeout_s=120, torchrun=torchrun)
    message = str(e.value)
    assert message.startswith("fail_on failed") and "timed out" not in message, message[:2000]
    assert "Traceback" in message and "RuntimeError: planted failure on rank 1" in message, message[-3000:]
    if not torchrun:
        assert "--- rank 1 (exit 1) ---" in message, message[:2000]


def test_a_hung_job_ends_at_its_timeout():
    with pytest.raises(AssertionError, match=r"sleep failed \(timed out after 2 s, rc=\[-9, -9\]\)"):
        launch.run("sleep", seconds=600, timeout_s=2)
