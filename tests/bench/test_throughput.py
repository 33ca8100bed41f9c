"""bench/throughput.py's pure parts: the kernel-interval math, the trace reader, the variants."""
import argparse
import importlib.util
import os

import pytest

from bench.throughput import (SPECS, VARIANTS, GpuActivity, PhasePeaks, _record_step_phases, covered, engine_config,
                              exposed, gpu_activities, intersection, layer_params, megatron_default_unit_elements,
                              timeline_summary, union)


# ---- intervals ---------------------------------------------------------------------------------
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


# ---- variants ----------------------------------------------------------------------------------
def _args(**kw):
    base = dict(dtype="bf16", attention="sdpa", recompute="none", fused_kernels=False,
                fsdp_overrides='{"overlap_param_gather": true}', ddp_overrides='{"overlap_grad_reduce": true}')
    return argparse.Namespace(**{**base, **kw})


def test_layer_params_and_megatron_default_unit():
    assert layer_params(SPECS["1.7b"]) == 4 * 2048**2 + 3 * 2048 * 5632 + 2 * 2048
    assert layer_params(SPECS["7b"]) == 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    # megatron's max() makes 1e9 a floor: a 7b layer is ~0.2e9, so the default is 1e9
    assert megatron_default_unit_elements(SPECS["7b"]) == 1_000_000_000


def test_variant_configs():
    spec, args = SPECS["1.7b"], _args()
    cfg = {m: engine_config(args, m, spec) for m in VARIANTS}
    assert not cfg["ddp"].use_megatron_fsdp and cfg["ddp"].override_ddp_config == {"overlap_grad_reduce": True}
    assert cfg["fsdp"].use_megatron_fsdp and cfg["fsdp"].override_ddp_config == {"overlap_param_gather": True}
    assert cfg["fsdp-no-overlap"].override_ddp_config == {"overlap_param_gather": False, "overlap_grad_reduce": False,
                                                          "suggested_communication_unit_size": 1}
    assert cfg["fsdp-unit2x"].override_ddp_config == {"overlap_param_gather": True,
                                                      "suggested_communication_unit_size": 2_000_000_000}
    assert cfg["fsdp-unit-min"].override_ddp_config["suggested_communication_unit_size"] == 2 * layer_params(spec)
    assert cfg["fsdp-recompute"].recompute == "full" and cfg["fsdp"].recompute == "none"
    assert cfg["fsdp-optoffload"].optimizer_offload and not cfg["fsdp"].optimizer_offload
    for m, c in cfg.items():  # each variant changes only what it names
        base = cfg[VARIANTS[m][0]]
        changed = {k for k, v in c.to_dict().items() if v != base.to_dict()[k]}
        assert changed <= {"override_ddp_config", "recompute", "optimizer_offload", "fused_kernels"}, (m, changed)
        assert c.dtype == "bf16" and c.attention_backend == "sdpa" and not c.fused_kernels
    fused = {m: engine_config(_args(fused_kernels=True), m, spec).fused_kernels for m in VARIANTS}
    assert fused == {m: m != "fsdp-unfused" for m in VARIANTS}


def test_phase_boundaries_wrap_the_optimizer_step():
    calls = []

    class Opt:
        def step(self):
            calls.append("step")
            return "out"

    class Peaks(PhasePeaks):
        def _close(self, phase):
            calls.append(phase)
    opt = Opt()
    _record_step_phases(opt, Peaks())
    assert opt.step() == "out" and calls == ["forward_backward", "step", "optimizer_step"]


def _megatron_fsdp_source() -> str:
    root = os.path.dirname(importlib.util.find_spec("megatron").submodule_search_locations[0])
    return open(os.path.join(root, "megatron", "core", "distributed", "fsdp", "src", "megatron_fsdp",
                             "megatron_fsdp.py")).read()


def test_megatron_still_floors_the_unit_size():
    """megatron_default_unit_elements copies megatron-core 0.16.1's `max(1e9, ...)`; when this
    fails, upstream took the `min` (Megatron-LM PR #7134): update it and the fsdp-unit* notes."""
    source = _megatron_fsdp_source()
    start = source.index("# Cap to 1B elements.")
    assert "max(" in source[start:start + 200].replace(" ", "")


def test_megatron_still_forces_overlap_when_fully_sharded():
    """fsdp-no-overlap stops the overlap with suggested_communication_unit_size=1 because
    MegatronFSDP overrides overlap_param_gather / overlap_grad_reduce to True for
    optim_grads_params; when this fails, the flags may work alone: re-check the variant."""
    source = _megatron_fsdp_source()
    assert "self.ddp_config.overlap_param_gather = True" in source
    assert "self.ddp_config.overlap_grad_reduce = True" in source
