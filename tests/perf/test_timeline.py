"""mfsdp_kit.perf.timeline: the kernel-interval math and the trace reader, on hand-made traces."""
import gzip
import json

import pytest

from mfsdp_kit.perf.timeline import (GpuActivity, covered, difference, exposed, gpu_activities, intersection,
                                     read_trace, timeline_summary, union)


# ---- intervals ---------------------------------------------------------------------------------
def test_difference_keeps_what_the_second_set_does_not_cover():
    assert difference([(0, 10)], [(2, 3), (5, 6), (9, 12)]) == [(0, 2), (3, 5), (6, 9)]


def test_union_sorts_merges_overlapping_and_touching_and_drops_empty():
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9), (8, 6)]) == [(0, 4), (5, 7)]
    assert union([]) == []


def test_covered_counts_overlap_once():
    assert covered([(0, 10), (2, 5), (8, 12)]) == 12
    assert covered([(0, 1), (2, 3)]) == 2


def test_intersection_of_two_unions():
    a = [(0, 4), (3, 10), (12, 20)]  # = (0, 10), (12, 20)
    b = [(2, 5), (9, 13), (19, 30)]
    assert intersection(a, b) == [(2, 5), (9, 10), (12, 13), (19, 20)]
    assert intersection(a, []) == []
    assert intersection([(0, 1)], [(1, 2)]) == []  # touching is not overlapping


def test_exposed_is_comm_time_without_any_compute():
    # NCCL on two streams (0..6 in all); compute on two streams covering 1..3 and 5..8
    comm = [(0, 4), (2, 6)]
    compute = [(1, 3), (2, 2.5), (5, 8)]
    assert exposed(comm, compute) == pytest.approx(6 - (2 + 1))
    assert exposed(comm, []) == 6  # nothing to hide behind
    assert exposed(comm, [(-1, 100)]) == 0  # fully hidden
    assert exposed([], compute) == 0


# ---- trace -> activities -> summary -------------------------------------------------------------
TRACE = {"traceEvents": [
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 50.0},
    {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 100.0, "dur": 300.0},
    {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL(x)", "ts": 200.0, "dur": 400.0},
    {"ph": "X", "cat": "Kernel", "name": "ncclKernel_ReduceScatter", "ts": 1000.0, "dur": 100.0},
    {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 700.0, "dur": 100.0},
    {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 750.0, "dur": 10.0},
    {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 1500.0, "dur": 50.0},
    {"ph": "s", "cat": "ac2g", "name": "flow", "ts": 100.0},
    {"ph": "M", "name": "process_name"},
]}


def test_gpu_activities_kinds():
    acts = gpu_activities(TRACE)
    assert [a.kind for a in acts] == ["compute", "nccl", "nccl", "memcpy", "memcpy", "compute"]
    assert acts[1] == GpuActivity("ncclDevKernel_AllGather_RING_LL(x)", "nccl", 200.0, 600.0)


def test_timeline_summary_per_step():
    # us: compute 100-400, 1500-1550; nccl 200-600, 1000-1100; memcpy 700-800 (+memset inside)
    s = timeline_summary(gpu_activities(TRACE), wall_s=0.004, steps=2)
    per_step = lambda us: us / 1e6 / 2  # noqa: E731
    assert s["step_s"] == pytest.approx(0.002)
    assert s["compute_kernel_s"] == pytest.approx(per_step(350))
    assert s["nccl_kernel_s"] == pytest.approx(per_step(500))
    assert s["memcpy_s"] == pytest.approx(per_step(110))
    assert s["nccl_exposed_s"] == pytest.approx(per_step(200 + 100))  # 400-600 and 1000-1100
    busy = 500 + 100 + 100 + 50  # 100-600, 700-800, 1000-1100, 1500-1550
    assert s["gpu_busy_s"] == pytest.approx(per_step(busy))
    assert s["gpu_idle_s"] == pytest.approx(0.002 - per_step(busy))
    top = s["top_kernels"]
    assert [k["name"] for k in top][:2] == ["ncclDevKernel_AllGather_RING_LL(x)", "sm90_xmma_gemm_bf16"]
    assert top[1]["calls"] == 2 and top[1]["s_per_step"] == pytest.approx(per_step(350))
    assert len(timeline_summary(gpu_activities(TRACE), wall_s=1, steps=1, top=3)["top_kernels"]) == 3


def test_timeline_summary_without_gpu_activity():
    s = timeline_summary([], wall_s=0.5, steps=2)
    assert s["num_activities"] == 0 and s["gpu_idle_s"] == 0.25 and s["nccl_exposed_s"] == 0




def test_read_trace_plain_and_gzipped(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps(TRACE))
    with gzip.open(tmp_path / "t.json.gz", "wt") as f:
        json.dump(TRACE, f)
    assert read_trace(str(tmp_path / "t.json")) == TRACE == read_trace(str(tmp_path / "t.json.gz"))
