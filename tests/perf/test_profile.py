"""perf.profile: collectives named by kind, exposed communication on hand-made steps with known
answers, a gloo trace read as the profiler writes it; and ddp / fsdp / fsdp2 profiled on 2 ranks."""
import pytest

from mfsdp_kit.perf.profile import Event, comm_kind, exposed_intervals, step_breakdown, trace_events
from tests.dist import launch


def ev(kind, start, end, lane="main", step=0, name="x"):
    return Event(name, kind, start, end, lane, step)


@pytest.mark.parametrize("name,kind", [
    ("c10d::allgather_into_tensor_coalesced_", "all_gather"), ("c10d::_allgather_base_", "all_gather"),
    ("c10d::reduce_scatter_tensor_coalesced_", "reduce_scatter"), ("c10d::_reduce_scatter_base_", "reduce_scatter"),
    ("c10d::allreduce_", "all_reduce"), ("_c10d_functional::all_reduce", "all_reduce"),
    ("c10d::broadcast_", "other_comm"), ("gloo:all_gather", "all_gather"), ("gloo:broadcast", "other_comm"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_gather"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "reduce_scatter"), ("ncclKernel_SendRecv", "other_comm"),
    ("_c10d_functional::wait_tensor", "wait"), ("FSDP::post_backward_rs_wait (decoder.layers.0)", "wait"),
    ("aten::mm", None), ("FSDP::all_gather (decoder.layers.0)", None), ("ampere_sgemm_128x64_tn", None)])
def test_comm_kind(name, kind):
    assert comm_kind(name) == kind


def test_exposed_on_known_steps():
    # compute 0-4 and 5-7; an all-gather transfer 2-6 hides under compute except 4-5
    events = [ev("compute", 0, 4), ev("all_gather", 2, 6, "gloo"), ev("compute", 5, 7)]
    assert exposed_intervals(events) == [(4, 5)]
    # compute the training thread runs INSIDE its own collective call hides nothing: the call blocks
    events = [ev("reduce_scatter", 1, 3), ev("compute", 1.5, 2), ev("reduce_scatter", 1, 4, "gloo"), ev("compute", 0, 1)]
    assert exposed_intervals(events) == [(1, 4)]
    row = step_breakdown(events + [ev("compute", 0, 0.5, step=1)], [(0, 5), (5, 7)])
    assert row["step_s"] == pytest.approx(3.5) and row["compute_s"] == pytest.approx((1 + 0.5) / 2)
    assert row["comm_s"] == pytest.approx(1.5) and row["exposed_comm_s"] == pytest.approx(1.5)
    assert row["idle_s"] == pytest.approx((1 + 1.5) / 2) and row["reduce_scatter_calls"] == 0.5


def test_gloo_trace_read():
    """A chrome trace as torch 2.13 writes it for gloo: the call on the training thread (tid 1), the
    transfer on a worker (tid 2; a reduce-scatter's is a gloo:all_reduce), leaf aten ops as compute."""
    x = lambda name, ts, dur, tid=1, cat="cpu_op": dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=tid)  # noqa: E731
    trace = dict(traceEvents=[
        x("mfsdp_kit::step 0", 1000, 100, cat="user_annotation"), x("mfsdp_kit::step 1", 1100, 50, cat="user_annotation"),
        x("autograd::engine::evaluate_function: MmBackward0", 1000, 20), x("aten::mm", 1005, 10),
        x("c10d::reduce_scatter_tensor_coalesced_", 1030, 5), x("aten::copy_", 1031, 2),
        x("gloo:all_reduce", 1036, 30, tid=2, cat="user_annotation"), x("aten::add", 1040, 10),
        x("c10d::allgather_into_tensor_coalesced_", 1120, 2), x("gloo:all_gather", 1122, 40, tid=2, cat="user_annotation")])
    events, spans = trace_events(trace, on_gpu=False)
    assert spans == [(0.0, 100e-6), (100e-6, 150e-6)]
    got = [(e.kind, e.lane, e.step, round(e.start_s * 1e6), round(e.end_s * 1e6)) for e in events]
    assert got == [("compute", "main", 0, 5, 15), ("reduce_scatter", "main", 0, 30, 35), ("compute", "main", 0, 31, 33),
                   ("reduce_scatter", "gloo", 0, 36, 66), ("compute", "main", 0, 40, 50),
                   ("all_gather", "main", 1, 20, 22), ("all_gather", "gloo", 1, 22, 50)]   # clipped at its step's end
    # exposed in step 0: the call 30-35 (its copy inside it hides nothing), the transfer 36-40 and 50-66
    assert [(round(s * 1e6), round(e * 1e6)) for s, e in exposed_intervals([e for e in events if e.step == 0])] == \
        [(30, 35), (36, 40), (50, 66)]


@pytest.mark.slow
def test_three_systems_on_two_gloo_ranks():
    res = launch.run("scenarios_profile:three_systems", timeout_s=400)
    for mode, ranks in res.items():
        for r in ranks:
            b = r["breakdown"]
            assert r["steps"] == 2 and r["in_span"] and "compute" in r["kinds"], (mode, r)
            assert 0 <= b["exposed_comm_s"] <= b["comm_s"] + 1e-12 and b["compute_s"] > 0, (mode, b)
            assert b["comm_s"] + b["compute_s"] + b["idle_s"] >= b["step_s"] - 1e-9, (mode, b)
            assert set(r["lanes"]) == {"main", "gloo"}, (mode, r["lanes"])
    for r in res["fsdp"] + res["fsdp2"]:   # ZeRO-3: weights all-gathered, grads reduce-scattered every step
        assert r["breakdown"]["all_gather_calls"] >= 2 and r["breakdown"]["reduce_scatter_calls"] >= 1, r
    for r in res["ddp"]:   # megatron DDP + distributed optimizer: grads reduce-scattered, loss/norm all-reduced
        assert r["breakdown"]["all_reduce_calls"] >= 1 and r["breakdown"]["reduce_scatter_calls"] >= 1, r
    assert all("wait" in r["kinds"] for r in res["fsdp2"])   # FSDP2 annotates its reduce-scatter waits
