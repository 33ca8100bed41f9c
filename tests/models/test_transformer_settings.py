"""models.transformer_settings: megatron's TransformerConfig fields from an EngineConfig, once for both model paths."""
import torch

from mfsdp_kit.config import EngineConfig, Kernels, Parallelism
from mfsdp_kit.models import gpt, transformer_settings as ts


def settings(cfg=None, *, te_spec=False, moe=False, cpu_initialization=True):
    return ts.engine_settings(cfg or EngineConfig(), te_spec=te_spec, moe=moe, cpu_initialization=cpu_initialization)


def test_what_both_paths_get():
    s = settings(EngineConfig(parallelism=Parallelism(tensor_model_parallel_size=2, context_parallel_size=2),
                              dtype="bf16", recompute="full"))
    assert (s["tensor_model_parallel_size"], s["context_parallel_size"], s["sequence_parallel"]) == (2, 2, False)
    assert s["bf16"] and not s["fp16"] and s["params_dtype"] is s["pipeline_dtype"] is torch.bfloat16
    assert (s["hidden_dropout"], s["attention_dropout"]) == (0.0, 0.0)
    assert (s["recompute_granularity"], s["recompute_method"], s["recompute_num_layers"]) == ("full", "uniform", 1)
    assert settings(EngineConfig(recompute="selective"))["recompute_granularity"] == "selective"
    assert "recompute_granularity" not in settings()


def test_te_only_fusions_go_off_on_the_local_spec_only():
    local, te = settings(moe=True), settings(te_spec=True, moe=True)
    off = {**ts.FUSIONS_OFF, **ts.NATIVE_CE_FUSION_OFF, **ts.MOE_TE_ONLY}
    assert all(local[k] == v for k, v in off.items()) and not set(off) & set(te)
    assert not set(ts.MOE_TE_ONLY) & set(settings())   # a dense model has no experts to set
    assert ts.fused_kernel_settings(EngineConfig(kernels=Kernels(fused_kernels=True)), {}, te_spec=True) == {}


def test_overrides_win_and_cpu_initialization_is_the_callers():
    cfg = EngineConfig(override_transformer_config={"hidden_dropout": 0.1, "apply_rope_fusion": True})
    s = settings(cfg, cpu_initialization=False)
    assert (s["hidden_dropout"], s["apply_rope_fusion"], s["use_cpu_initialization"]) == (0.1, True, False)


def test_the_gpt_path_is_built_from_them():
    cfg = EngineConfig(dtype="bf16", recompute="selective")
    config = gpt.transformer_config(gpt.SPECS["tiny"], cfg)
    for key, value in settings(cfg).items():
        assert getattr(config, key) == value, key
