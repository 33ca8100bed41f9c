"""`distributed.clock`, the one timer of the benches: a span owns its work (host work included), `mean_ms` leaves its
warm-up calls out, and on a GPU the same spans come from CUDA events."""
import time

import pytest
import torch

from mfsdp_kit.distributed import clock

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_a_span_owns_its_host_work(device):
    with clock.timed(device=device) as t:
        time.sleep(0.05)
    assert 0.05 <= t.seconds < 0.5
    took, out = clock.seconds(lambda: time.sleep(0.02) or "done", device=device)
    assert out == "done" and 0.02 <= took < 0.5


@pytest.mark.parametrize("device", DEVICES)
def test_mean_ms_times_the_repeats_after_the_warmup(device):
    calls = []

    def fn():
        calls.append(len(calls))
        time.sleep(0.2 if len(calls) <= 2 else 0.01)   # the warm-up calls are slow (a compile, say)

    ms = clock.mean_ms(fn, repeats=5, warmup=2, device=device)
    assert len(calls) == 7 and 10 <= ms < 100


@pytest.mark.parametrize("device", DEVICES)
def test_marks_of_one_device_give_seconds(device):
    start = clock.mark(device)
    time.sleep(0.02)
    assert 0.02 <= clock.seconds_between(start, clock.mark(device)) < 0.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_on_a_gpu_the_span_waits_for_the_kernels():
    x = torch.randn(4096, 4096, device="cuda")
    with clock.timed(device="cuda") as t:
        for _ in range(20):
            x = x @ x / 64
    assert t.seconds > 0 and torch.cuda.current_stream().query()   # drained when the span ends
