"""perf.kernel_mix: kernels classed by name, a phase's time split into classes and host gaps, from a chrome trace
of the shape torch.profiler writes (phases marked by `timeline.phase`)."""
import torch

from mfsdp_kit.perf.kernel_mix import CLASSES, breakdown, classify, format_breakdown
from mfsdp_kit.perf.timeline import PHASE_MARK, phase


def test_classify_names_the_kernels_of_a_training_step():
    assert classify("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert classify("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert classify("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64>>") == "attention"
    assert classify("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert classify("ncclDevKernel_AllGather_RING_LL") == "nccl"
    assert classify("Memcpy DtoD (Device -> Device)") == "copy"
    assert classify("triton_poi_fused_mul_silu_0") == "other"


def test_breakdown_splits_a_phase_into_classes_and_host_gaps():
    def x(name, cat, ts, dur):
        return dict(ph="X", name=name, cat=cat, ts=ts, dur=dur)
    trace = {"traceEvents": [
        x(PHASE_MARK + "update", "user_annotation", 0, 100),
        x("sm90_xmma_gemm", "kernel", 10, 30), x("sm90_xmma_gemm", "kernel", 30, 20),   # overlap counted once
        x("flash_bwd", "kernel", 60, 10), x("Memcpy HtoD", "gpu_memcpy", 80, 5),
        x("triton_poi_fused", "kernel", 150, 10),                                          # after the phase
        x(PHASE_MARK + "logprobs", "user_annotation", 200, 50), x("gemm", "kernel", 210, 40)]}
    rows = breakdown(trace)
    up = rows["update"]
    assert (up["wall_s"], up["gemm_s"], up["attention_s"], up["copy_s"]) == (1e-4, 4e-5, 1e-5, 5e-6)
    assert abs(up["host_gap_s"] - 4.5e-5) < 1e-12 and up["kernels"] == 4
    assert rows["logprobs"]["gemm_s"] == 4e-5 and abs(rows["logprobs"]["host_gap_s"] - 1e-5) < 1e-12
    assert up["top"] == [["sm90_xmma_gemm", "gemm", 5e-5, 2], ["flash_bwd", "attention", 1e-5, 1],
                         ["Memcpy HtoD", "copy", 5e-6, 1]]   # by summed seconds, overlaps not merged
    table = format_breakdown(rows)
    assert all(c in table for c in CLASSES) and "update" in table and "update top" in table


def test_host_gaps_are_named_by_the_host_events_that_overlap_them():
    def x(name, cat, ts, dur):
        return dict(ph="X", name=name, cat=cat, ts=ts, dur=dur)
    trace = {"traceEvents": [
        x(PHASE_MARK + "update", "user_annotation", 0, 100),
        x("gemm", "kernel", 0, 40), x("gemm", "kernel", 70, 30),             # gaps: 40..70
        x("aten::nonzero", "cpu_op", 35, 20),                                # 15 us in the gap
        x("cudaStreamSynchronize", "cuda_runtime", 50, 10),                  # 10 us
        x("aten::mm", "cpu_op", 60, 30),                                     # 10 us, the rest under a kernel
        x("aten::add", "cpu_op", 10, 20),                                    # none: a kernel runs
        x("aten::nonzero", "cpu_op", 120, 5)]}                               # after the phase
    ops = breakdown(trace)["update"]["gap_ops"]
    assert ops == [["aten::nonzero", "cpu_op", 1.5e-5, 1], ["cudaStreamSynchronize", "cuda_runtime", 1e-5, 1],
                   ["aten::mm", "cpu_op", 1e-5, 1]]
    assert "update in host gaps" in format_breakdown(breakdown(trace))


def test_a_phase_is_a_profiler_range():
    from torch.profiler import profile
    with profile() as prof:
        with phase("rollout"):
            torch.ones(4).sum()
    assert any(e.name == PHASE_MARK + "rollout" for e in prof.events())
