"""mfsdp_kit.perf.variants / flops / peaks: the variants' configs, the FLOP accounting, the phase
boundaries, and canaries for the megatron behaviour the variants' notes rely on."""
import argparse
import importlib.util
import os

import pytest

from mfsdp_kit.config.flat import flat_values
from mfsdp_kit.models.gpt import SPECS
from mfsdp_kit.perf.flops import flops_per_token, layer_params, matmul_params, mfu
from mfsdp_kit.perf.peaks import PhasePeaks, record_step_phases
from mfsdp_kit.perf.variants import (VARIANTS, add_engine_args, engine_config, engine_config_from_args, fsdp2_options,
                                     megatron_default_unit_elements, optim_overrides, uses_megatron_finalize,
                                     parse_modes)


# ---- variants ----------------------------------------------------------------------------------
SETTINGS = dict(dtype="bf16", attention="sdpa", recompute="none", fused_kernels=False,
                fsdp_overrides={"overlap_param_gather": True}, ddp_overrides={"overlap_grad_reduce": True})


def test_flops_per_token_by_hand():
    spec = SPECS["1.7b"]  # N = 24 layers + final norm + output layer; the input embedding is a lookup
    n = 24 * (4 * 2048**2 + 3 * 2048 * 5632 + 2 * 2048) + 2048 + 32768 * 2048
    assert matmul_params(spec) == n == 1_300_334_592
    assert flops_per_token(spec) == 6 * n + 12 * 24 * 2048 * 2048
    assert mfu(54_000, spec) == pytest.approx(54_000 * flops_per_token(spec) / 989e12)
    assert mfu(1.0, spec, peak_flops=flops_per_token(spec)) == 1.0


def test_layer_params_and_megatron_default_unit():
    assert layer_params(SPECS["1.7b"]) == 4 * 2048**2 + 3 * 2048 * 5632 + 2 * 2048
    assert layer_params(SPECS["7b"]) == 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    # megatron's max() makes 1e9 a floor: a 7b layer is ~0.2e9, so the default is 1e9
    assert megatron_default_unit_elements(SPECS["7b"]) == 1_000_000_000


def test_variant_configs():
    spec = SPECS["1.7b"]
    cfg = {m: engine_config(m, spec, **SETTINGS) for m in VARIANTS}
    wrap = {m: c.wrapper for m, c in cfg.items()}
    assert not wrap["ddp"].use_megatron_fsdp and wrap["ddp"].override_ddp_config == {"overlap_grad_reduce": True}
    assert wrap["fsdp"].use_megatron_fsdp and wrap["fsdp"].override_ddp_config == {"overlap_param_gather": True}
    assert wrap["fsdp-no-overlap"].override_ddp_config == {"overlap_param_gather": False, "overlap_grad_reduce": False,
                                                           "suggested_communication_unit_size": 1}
    assert wrap["fsdp-unit2x"].override_ddp_config == {"overlap_param_gather": True,
                                                       "suggested_communication_unit_size": 2_000_000_000}
    assert wrap["fsdp-unit-1e9"].override_ddp_config["suggested_communication_unit_size"] == 1_000_000_000
    assert cfg["ddp-recompute"].recompute == cfg["fsdp2-recompute"].recompute == "full"
    assert optim_overrides("fsdp-foreach-adam", spec) == {"adam_implementation": "foreach"} and not optim_overrides("fsdp", spec)
    assert cfg["fsdp-recompute"].recompute == "full" and cfg["fsdp"].recompute == "none"
    assert cfg["fsdp-optoffload"].offload.optimizer_offload and not cfg["fsdp"].offload.optimizer_offload
    comm = {m: c.communication for m, c in cfg.items()}
    assert comm["fsdp-ag-group-hp"].fsdp_all_gather_group and comm["fsdp-ag-group-hp"].high_priority_comm
    assert cfg["fsdp-ce-fusion"].override_transformer_config["cross_entropy_loss_fusion"] is True
    assert comm["fsdp-ctas8"].nccl_max_ctas == comm["ddp-ctas8"].nccl_max_ctas == 8
    assert comm["fsdp"].nccl_max_ctas is None
    assert all(cfg[f"{t}-fused-ce"].kernels.fused_cross_entropy for t in ("ddp", "fsdp", "fsdp2"))
    assert not cfg["fsdp"].kernels.fused_cross_entropy
    assert uses_megatron_finalize("fsdp-megatron-finalize", spec) and uses_megatron_finalize("ddp-megatron-finalize", spec)
    assert not uses_megatron_finalize("fsdp", spec)
    assert wrap["fsdp-keep-gathered"].fsdp_keep_gathered and not wrap["fsdp"].fsdp_keep_gathered
    assert fsdp2_options("fsdp2-keep-gathered", spec) == {"keep_gathered": True} and not fsdp2_options("fsdp2", spec)
    assert cfg["fsdp2-keep-gathered"] == cfg["fsdp2"]   # its option is build_fsdp2's, not an EngineConfig field
    assert cfg["fsdp-lora16"].lora.rank == cfg["ddp-lora16"].lora.rank == 16 and cfg["fsdp"].lora is None
    for m, c in cfg.items():  # each variant changes only what it names
        base = cfg[VARIANTS[m][0]]
        changed = {k for k, v in flat_values(c).items() if v != flat_values(base)[k]}
        assert changed <= {"override_ddp_config", "recompute", "optimizer_offload", "fused_kernels",
                           "fsdp_all_gather_group", "high_priority_comm", "override_transformer_config",
                           "nccl_max_ctas", "fused_cross_entropy", "fsdp_keep_gathered", "lora"}, (m, changed)
        assert c.dtype == "bf16" and c.kernels.attention_backend == "sdpa" and not c.kernels.fused_kernels
    fused = {m: engine_config(m, spec, **{**SETTINGS, "fused_kernels": True}).kernels.fused_kernels for m in VARIANTS}
    assert fused == {m: m != "fsdp-unfused" for m in VARIANTS}


def test_engine_config_from_the_command_line():
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    args = ap.parse_args(["--dtype", "bf16", "--fsdp-overrides", '{"suggested_communication_unit_size": 7}'])
    cfg = engine_config_from_args(args, "fsdp-recompute", SPECS["tiny"])
    assert cfg.wrapper.use_megatron_fsdp and cfg.recompute == "full" and cfg.dtype == "bf16"
    assert cfg.wrapper.override_ddp_config == {"suggested_communication_unit_size": 7}
    ddp = engine_config_from_args(args, "ddp", SPECS["tiny"])
    assert ddp.wrapper.override_ddp_config == {"overlap_grad_reduce": True}
    assert parse_modes(ap, "ddp, fsdp2,") == ["ddp", "fsdp2"]
    with pytest.raises(SystemExit):
        parse_modes(ap, "ddp,zero3")


def test_phase_boundaries_wrap_the_optimizer_step():
    calls = []

    class Opt:
        def step(self):
            calls.append("step")
            return "out"

    class Peaks(PhasePeaks):
        def close(self, phase):
            calls.append(phase)
    opt = Opt()
    record_step_phases(opt, Peaks())
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
