"""distributed.progress: a report reaches every listener once, and `latest` keeps it (what the heartbeat reads)."""
from mfsdp_kit.distributed import progress


def test_a_report_reaches_each_listener_once_and_is_kept():
    got = []
    progress.listen(got.append)
    progress.listen(got.append)   # added twice, called once
    try:
        progress.report(step=3, total=10, loss=0.5)
    finally:
        progress.unlisten(got.append)
    assert got == [dict(step=3, total=10, loss=0.5)]
    assert {k: v for k, v in progress.latest.items() if k != "t"} == dict(step=3, total=10, loss=0.5)
    assert progress.reported.is_set()
