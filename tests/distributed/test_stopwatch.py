"""distributed.stopwatch: the phases are laps of one run of marks."""
import time

from mfsdp_kit.distributed.stopwatch import Stopwatch


def test_a_stopwatchs_laps_partition_its_span():
    """Each lap starts where the last ended: the phases sum to `lapped()` exactly, a repeated name adds up, and a
    given `phases` dict is filled in place from a given start mark."""
    phases, start = {"before": 1.0}, time.perf_counter()
    watch = Stopwatch(phases, start=start)
    for name in ("a", "b", "a"):
        time.sleep(0.002)
        end = watch.lap(name)
    assert watch.phases is phases and list(phases) == ["before", "a", "b"]
    assert end == watch.last and watch.lapped() == end - start
    assert abs(phases["a"] + phases["b"] - watch.lapped()) < 1e-9 and phases["a"] >= 0.004 and phases["b"] >= 0.002
    assert watch.total() >= watch.lapped()
