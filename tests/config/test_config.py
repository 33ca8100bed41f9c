"""Every validation error names the field, the bad value and what is allowed."""
import dataclasses
import warnings

import pytest

from mfsdp_kit.config import ConfigError, EngineConfig, OptimConfig, ddp_config
from mfsdp_kit.config.flat import FLAT_NAMES
from mfsdp_kit.config.sections import SECTIONS, Communication, Kernels, Offload, Parallelism, Wrapper
from mfsdp_kit.fieldtypes import field_docs
from mfsdp_kit.config.parallel_dims import ParallelDims


def raises(match, **kwargs):
    """The message of the ConfigError raised when the config is made (each check here needs only its fields)."""
    with pytest.raises(ConfigError, match=match) as e:
        EngineConfig(**kwargs)
    return str(e.value)


@pytest.mark.parametrize("field", ["tensor_model_parallel_size", "pipeline_model_parallel_size",
                                   "context_parallel_size", "expert_model_parallel_size"])
@pytest.mark.parametrize("value", [0, -2])
def test_non_positive_sizes(field, value):
    msg = raises(field, **{field: value})
    assert repr(value) in msg and "positive integer" in msg


def test_unknown_override_key_lists_close_matches():
    msg = raises("override_ddp_config", override_ddp_config={"overlap_grad_reduc": True})
    assert "'overlap_grad_reduc'" in msg and "overlap_grad_reduce" in msg and "did you mean" in msg


def test_unknown_transformer_override():
    msg = raises("override_transformer_config", override_transformer_config={"hiden_size": 8})
    assert "hidden_size" in msg


def test_bad_sharding_strategy():
    msg = raises("data_parallel_sharding_strategy",
                 override_ddp_config={"data_parallel_sharding_strategy": "zero3"})
    assert "'zero3'" in msg and "optim_grads_params" in msg and "no_shard" in msg


def test_world_size_not_divisible():
    with pytest.raises(ConfigError, match="world_size") as e:
        EngineConfig(tensor_model_parallel_size=2, context_parallel_size=2).validate(world_size=6, on_gpu=False)
    assert "6" in str(e.value) and "2*1*2 = 4" in str(e.value)


def test_expert_parallel_must_divide_the_data_parallel_ranks():
    with pytest.raises(ConfigError, match="expert_model_parallel_size=4 is not allowed") as e:
        EngineConfig(expert_model_parallel_size=4, tensor_model_parallel_size=2).validate(world_size=4, on_gpu=False)
    assert "world_size=4" in str(e.value)
    EngineConfig(expert_model_parallel_size=2, tensor_model_parallel_size=2).validate(world_size=4, on_gpu=False)
    EngineConfig(expert_model_parallel_size=2, context_parallel_size=2).validate(world_size=2, on_gpu=False)


@pytest.mark.parametrize("key", ["expert_model_parallel_size", "expert_tensor_parallel_size"])
def test_expert_layout_overrides_are_refused(key):
    msg = raises(f"override_transformer_config.{key}", override_transformer_config={key: 2})
    assert "absent" in msg and ("parallelism.expert_model_parallel_size" in msg or "tensor_model_parallel_size" in msg)


def test_fsdp_requires_distributed_optimizer():
    msg = raises("use_distributed_optimizer", use_megatron_fsdp=True, use_distributed_optimizer=False)
    assert "use_megatron_fsdp=True" in msg


def test_fsdp_with_one_cuda_connection_on_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ConfigError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        EngineConfig(use_megatron_fsdp=True).validate(on_gpu=True)
    EngineConfig(use_megatron_fsdp=True).validate(on_gpu=False)  # the rule is about CUDA streams
    EngineConfig(use_megatron_fsdp=False).validate(on_gpu=True)


def test_fsdp_with_pipeline_parallel_is_refused_in_plain_words():
    msg = raises("pipeline_model_parallel_size", use_megatron_fsdp=True, pipeline_model_parallel_size=2)
    assert "does not implement pipeline-parallel" in msg and "use DDP" in msg


@pytest.mark.parametrize("field,value", [("dtype", "float32"), ("attention_backend", "flash"),
                                         ("recompute", "some")])
def test_enumerated_fields(field, value):
    msg = raises(field, **{field: value})
    assert repr(value) in msg and "allowed" in msg


def test_vpp_needs_pipeline():
    raises("virtual_pipeline_model_parallel_size", virtual_pipeline_model_parallel_size=2)


def test_ddp_config_fsdp_defaults_then_overrides(monkeypatch):
    import mfsdp_kit.config as config
    d = ddp_config(EngineConfig(use_megatron_fsdp=True))  # CPU: synchronous communication
    assert (d.overlap_grad_reduce, d.overlap_param_gather, d.gradient_reduce_div_fusion) == (False, False, False)
    monkeypatch.setattr(config, "_cuda_available", lambda: True)  # verl's defaults on GPU
    d = ddp_config(EngineConfig(use_megatron_fsdp=True))
    assert (d.use_megatron_fsdp, d.use_distributed_optimizer, d.check_for_nan_in_grad, d.overlap_grad_reduce,
            d.data_parallel_sharding_strategy) == (True, True, True, True, "optim_grads_params")
    d = ddp_config(EngineConfig(use_megatron_fsdp=True, override_ddp_config={
        "overlap_grad_reduce": False, "data_parallel_sharding_strategy": "optim_grads"}))
    assert d.overlap_grad_reduce is False and d.data_parallel_sharding_strategy == "optim_grads"
    d = ddp_config(EngineConfig())
    assert d.use_megatron_fsdp is False and d.use_distributed_optimizer is True


def test_yaml_and_dict_round_trip(tmp_path):
    cfg = EngineConfig(use_megatron_fsdp=True, tensor_model_parallel_size=2, dtype="bf16",
                       override_ddp_config={"overlap_param_gather": True})
    path = tmp_path / "engine.yaml"
    cfg.to_yaml(str(path))
    assert EngineConfig.from_yaml(str(path)) == cfg
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="EngineConfig.use_fsdp"):
        EngineConfig.from_dict({"use_fsdp": True})


def test_optim_config_validation():
    with pytest.raises(ConfigError, match="lr"):
        OptimConfig(lr=0)
    with pytest.raises(ConfigError, match="warmup_steps"):
        OptimConfig(warmup_steps=-1)


# The validation battery (bad values a hostile or careless user tried), one row per case: each was accepted, or failed only
# inside megatron after the process group existed. (config kwargs, field the message must name).
ENGINE_CASES = [
    (dict(override_ddp_config={"bucket_size": "big"}), "wrapper.override_ddp_config.bucket_size"),
    (dict(override_ddp_config={"overlap_grad_reduce": "yes"}), "wrapper.override_ddp_config.overlap_grad_reduce"),
    (dict(override_ddp_config={"bucket_size": -5}), "wrapper.override_ddp_config.bucket_size"),
    (dict(use_megatron_fsdp="no"), "wrapper.use_megatron_fsdp"),
    (dict(tensor_model_parallel_size=True), "parallelism.tensor_model_parallel_size"),
    (dict(override_transformer_config={"num_layers": "2"}), "override_transformer_config.num_layers"),
    (dict(seed="abc"), "seed"),
    (dict(override_transformer_config={"num_layers": 0}), "override_transformer_config.num_layers"),
    (dict(override_transformer_config={"normalization": "BatchNorm"}), "override_transformer_config.normalization"),
    (dict(override_transformer_config={"hidden_dropout": 1.5}), "override_transformer_config.hidden_dropout"),
    (dict(virtual_pipeline_model_parallel_size="2"), "parallelism.virtual_pipeline_model_parallel_size"),
    (dict(fused_kernels=1), "kernels.fused_kernels"),
    (dict(nccl_max_ctas="8"), "communication.nccl_max_ctas"),
    (dict(fsdp_all_gather_group="yes"), "communication.fsdp_all_gather_group"),
]
ENGINE_CPU_CASES = [   # allowed when made (on a CPU-only kernel, for GPU engines), refused by validate(on_gpu=False)
    (dict(override_ddp_config={"fsdp_double_buffer": True}), "wrapper.override_ddp_config.fsdp_double_buffer"),
    (dict(override_ddp_config={"nccl_ub": True}), "wrapper.override_ddp_config.nccl_ub"),
    (dict(high_priority_comm=True), "communication.high_priority_comm"),   # an NCCL option
    (dict(nccl_max_ctas=8), "communication.nccl_max_ctas"),                # an NCCL option
]
OPTIM_CASES = [
    (dict(lr=-1), "lr"), (dict(lr="1e-3"), "lr"), (dict(adam_beta1=1.5), "adam_beta1"), (dict(lr=float("inf")), "lr"),
    (dict(adam_beta2=-0.1), "adam_beta2"), (dict(weight_decay=-0.1), "weight_decay"), (dict(adam_eps=-1e-8), "adam_eps"),
    (dict(lr=1e-3, min_lr=1e-2), "min_lr"), (dict(clip_grad=float("nan")), "clip_grad"), (dict(decay_steps=-5), "decay_steps"),
    (dict(lr=float("nan")), "lr"), (dict(warmup_steps=1.5), "warmup_steps"), (dict(decay_steps=0), "decay_steps"),
    (dict(adam_implementation="apex"), "adam_implementation"), (dict(lr=0), "lr"), (dict(lr=True), "lr"),
    (dict(adam_beta1=float("nan")), "adam_beta1"), (dict(adam_eps=float("nan")), "adam_eps"),
]


def _says_field_value_allowed(msg: str, field: str, value) -> None:
    assert msg.startswith(f"{field}="), msg
    assert repr(value) in msg and "allowed:" in msg, msg


@pytest.mark.parametrize("kwargs,field,made", [(*case, True) for case in ENGINE_CASES] + [
    (*case, False) for case in ENGINE_CPU_CASES], ids=[f for _, f in ENGINE_CASES + ENGINE_CPU_CASES])
def test_bad_engine_value_is_a_config_error_naming_it(kwargs, field, made):
    """`made`: refused by EngineConfig(...); else made, and refused by validate() on a machine without a GPU."""
    (name, value), = kwargs.items()
    if isinstance(value, dict):
        (_, value), = value.items()
    with pytest.raises(ConfigError) as e:
        cfg = EngineConfig(**kwargs)
        assert not made, "made without a ConfigError"
        cfg.validate(on_gpu=False)
    _says_field_value_allowed(str(e.value), field, value)


@pytest.mark.parametrize("kwargs,field", OPTIM_CASES, ids=[f"{f}-{i}" for i, (_, f) in enumerate(OPTIM_CASES)])
def test_bad_optim_value_is_a_config_error_naming_it(kwargs, field):
    """Raised when the config is made (issue 36 case 6: only at build_optimizer, after the model existed)."""
    with pytest.raises(ConfigError) as e:
        OptimConfig(**kwargs)
    _says_field_value_allowed(str(e.value), field, kwargs[field])


@pytest.mark.parametrize("kwargs", [
    dict(override_ddp_config={"bucket_size": None, "suggested_communication_unit_size": None}),
    dict(override_ddp_config={"bucket_size": 40_000_000, "overlap_grad_reduce": True}),
    dict(override_transformer_config={"num_layers": 2, "layernorm_epsilon": 1, "apply_rope_fusion": False,
                                      "params_dtype": object()}),   # unknown kinds (torch.dtype) are not judged
    dict(seed=0, virtual_pipeline_model_parallel_size=None)])
def test_good_values_pass(kwargs):
    EngineConfig(**kwargs).validate(on_gpu=False)


def test_good_optim_values_pass():
    OptimConfig(lr=1, min_lr=1, clip_grad=0, adam_beta1=0, decay_steps=None, weight_decay=0).validate()
    OptimConfig(adam_implementation="fused").validate()


def test_no_fp32_weights_only_in_fp32():
    msg = raises("preserve_fp32_weights", dtype="bf16", override_ddp_config={"preserve_fp32_weights": False})
    assert "False" in msg and "clip_grads.py:167" in msg
    EngineConfig(dtype="fp32", override_ddp_config={"preserve_fp32_weights": False}).validate(on_gpu=False)


def test_gpu_only_buffers_pass_on_gpu():
    EngineConfig(override_ddp_config={"fsdp_double_buffer": True, "nccl_ub": True}, high_priority_comm=True,
                 nccl_max_ctas=8).validate(on_gpu=True)


@pytest.mark.parametrize("ctas", [0, 33, -1])
def test_nccl_max_ctas_range(ctas):
    with pytest.raises(ConfigError, match=r"nccl_max_ctas=.*\[1, 32\]"):
        EngineConfig(nccl_max_ctas=ctas)   # NCCL's range: refused when made, GPU or not


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)   # callers' `except ValueError` keeps working


# ---- sections, the rank arithmetic, the old flat names (issue 39, item 2) ----------------------------------
def test_every_field_of_every_section_is_documented():
    for cls in (EngineConfig, *SECTIONS.values()):
        docs = field_docs(cls)
        undocumented = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not undocumented, (cls.__name__, undocumented)
    assert set(FLAT_NAMES) == {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)}


def test_validate_names_a_section_field_by_its_path():
    msg = raises(r"^parallelism\.context_parallel_size=0 ", parallelism=Parallelism(context_parallel_size=0))
    assert "positive integer" in msg
    raises(r"^kernels\.attention_backend='flash' ", kernels=Kernels(attention_backend="flash"))
    raises(r"^parallelism=\{", parallelism={"tensor_model_parallel_size": 2})   # a dict is not a section


def test_parallel_dims_does_the_rank_arithmetic():
    dims = ParallelDims(world=16, tp=2, dp_replicate=2)   # 2 nodes x 8 GPUs, TP 2, HSDP across the nodes
    assert (dims.dp, dims.dp_shard, dims.dp_cp, dims.model_parallel, dims.hsdp) == (8, 4, 8, 2, True)
    assert dims.dp_replicate * dims.dp_shard * dims.tp * dims.pp == dims.world
    cp = ParallelDims(world=8, cp=2)                      # a replica shards over its data x context ranks
    assert (cp.dp, cp.dp_cp, cp.dp_shard, cp.hsdp) == (4, 8, 8, False)
    moe = EngineConfig(parallelism=Parallelism(expert_model_parallel_size=2, tensor_model_parallel_size=2))
    assert moe.parallel_dims(8).expert_dp == 2 and moe.data_parallel_size(8) == moe.parallel_dims(8).dp == 4


@pytest.mark.parametrize("dims, named", [
    (dict(world=6, tp=2, cp=2), "world_size=6 .*2\\*1\\*2 = 4"),
    (dict(world=4, tp=2, ep=4), "parallelism.expert_model_parallel_size=4 .*world_size=4"),
    (dict(world=4, dp_replicate=3), "parallelism.data_parallel_replicate_size=3 .*a divisor of the 4 data x context"),
    (dict(world=8, tp=2, ep=2, dp_replicate=4), "data_parallel_replicate_size=4 .*experts' 2 data-parallel ranks"),
    (dict(world=8, dp_replicate=2, dp_shard=2), "parallelism.data_parallel_shard_size=2 .*-1 or 4"),
    (dict(world=4, tp=0), "parallelism.tensor_model_parallel_size=0 .*a positive integer"),   # not a ZeroDivisionError
    (dict(world=4, pp=-2), "parallelism.pipeline_model_parallel_size=-2 .*a positive integer"),
    (dict(world=4, cp=1.5), "parallelism.context_parallel_size=1.5 .*a positive integer"),
    (dict(world=0), "world_size=0 .*a positive integer"),
    (dict(world=4, dp_shard=0), "parallelism.data_parallel_shard_size=0 .*-1 .*or a positive integer"),
])
def test_parallel_dims_refuses_what_does_not_divide(dims, named):
    with pytest.raises(ConfigError, match=named):
        ParallelDims(**dims)


def test_hsdp_as_fields_equals_the_old_override_path():
    old_key = {"num_distributed_optimizer_instances": 2, "overlap_grad_reduce": False}
    with pytest.warns(DeprecationWarning, match="parallelism.data_parallel_replicate_size"):
        old = EngineConfig(use_megatron_fsdp=True, override_ddp_config=old_key)
    new = EngineConfig(wrapper=Wrapper(use_megatron_fsdp=True, override_ddp_config={"overlap_grad_reduce": False}),
                       parallelism=Parallelism(data_parallel_replicate_size=2))
    assert old == new and old_key["num_distributed_optimizer_instances"] == 2   # the caller's dict is untouched
    for cfg in (old, new):
        cfg.validate(world_size=4, on_gpu=False)
        d = ddp_config(cfg)
        assert (d.num_distributed_optimizer_instances, d.overlap_grad_reduce, d.use_megatron_fsdp) == (2, False, True)
        assert cfg.parallel_dims(4).dp_shard == 2
    assert ddp_config(EngineConfig()).num_distributed_optimizer_instances == 1
    with warnings.catch_warnings(), pytest.raises(ConfigError, match="num_distributed_optimizer_instances=4 .*absent: "
                                                                     "set parallelism.data_par"):
        warnings.simplefilter("ignore", DeprecationWarning)
        EngineConfig(parallelism=Parallelism(data_parallel_replicate_size=2),   # refused when made
                     override_ddp_config={"num_distributed_optimizer_instances": 4})


BAD_WHEN_MADE = [
    (dict(dtype="bf32"), r"^dtype='bf32' is not allowed; allowed: bf16 \| fp16 \| fp32"),
    (dict(recompute="all"), r"^recompute='all'"), (dict(seed=-1), r"^seed=-1"), (dict(seed="abc"), r"^seed='abc'"),
    (dict(seed=2**63), r"^seed=9223372036854775808"), (dict(seed=True), r"^seed=True"),
    (dict(parallelism=Parallelism(tensor_model_parallel_size=0)), r"^parallelism.tensor_model_parallel_size=0"),
    (dict(parallelism=Parallelism(tensor_model_parallel_size=True)), r"^parallelism.tensor_model_parallel_size=True"),
    (dict(parallelism=Parallelism(pipeline_model_parallel_size="2")), r"^parallelism.pipeline_model_parallel_size='2'"),
    (dict(parallelism=Parallelism(context_parallel_size=-1)), r"^parallelism.context_parallel_size=-1"),
    (dict(parallelism=Parallelism(expert_model_parallel_size=2.0)), r"^parallelism.expert_model_parallel_size=2.0"),
    (dict(parallelism=Parallelism(data_parallel_replicate_size=0)), r"^parallelism.data_parallel_replicate_size=0"),
    (dict(parallelism=Parallelism(data_parallel_shard_size=0)), r"^parallelism.data_parallel_shard_size=0"),
    (dict(parallelism=Parallelism(virtual_pipeline_model_parallel_size=0)),
     r"^parallelism.virtual_pipeline_model_parallel_size=0"),
    (dict(parallelism=Parallelism(virtual_pipeline_model_parallel_size=2)),
     r"^parallelism.virtual_pipeline_model_parallel_size=2 .*pipeline_model_parallel_size == 1"),
    (dict(parallelism=Parallelism(pipeline_model_parallel_size=2), wrapper=Wrapper(use_megatron_fsdp=True)),
     r"^parallelism.pipeline_model_parallel_size=2 .*use_megatron_fsdp=True"),
    (dict(parallelism=4), r"^parallelism=4 .*config.sections.Parallelism"),
    (dict(wrapper=Wrapper(use_megatron_fsdp="yes")), r"^wrapper.use_megatron_fsdp='yes'"),
    (dict(wrapper=Wrapper(use_megatron_fsdp=True, use_distributed_optimizer=False)),
     r"^wrapper.use_distributed_optimizer=False"),
    (dict(wrapper=Wrapper(override_ddp_config="optim")), r"^wrapper.override_ddp_config='optim'"),
    (dict(wrapper=Wrapper(override_ddp_config={"data_parallel_sharding_strategy": "zero3"})), r"'zero3'"),
    (dict(wrapper=Wrapper(override_ddp_config={"overlap_grad_reduc": True})), r"overlap_grad_reduc.*did you mean"),
    (dict(wrapper=Wrapper(fsdp_keep_gathered=True)), r"^wrapper.fsdp_keep_gathered=True"),
    (dict(dtype="bf16", wrapper=Wrapper(override_ddp_config={"preserve_fp32_weights": False})),
     r"preserve_fp32_weights=False .*dtype='bf16'"),
    (dict(override_transformer_config={"hiden_size": 8}), r"hiden_size.*hidden_size"),
    (dict(kernels=Kernels(attention_backend="flash")), r"^kernels.attention_backend='flash'"),
    (dict(kernels=Kernels(fused_kernels="yes")), r"^kernels.fused_kernels='yes'"),
    (dict(communication=Communication(nccl_max_ctas=0)), r"^communication.nccl_max_ctas=0 .*\[1, 32\]"),
    (dict(offload=Offload(optimizer_offload=1)), r"^offload.optimizer_offload=1"),
    (dict(lora={"rank": 4}), r"^lora=\{'rank': 4\}"),
    # issue 52: the field-only checks the rows above did not reach
    (dict(wrapper=Wrapper(override_ddp_config={"bucket_size": -5})), r"^wrapper.override_ddp_config.bucket_size=-5"),
    (dict(override_transformer_config={"expert_model_parallel_size": 2}),
     r"^override_transformer_config.expert_model_parallel_size=2 .*absent"),
    (dict(wrapper=Wrapper(use_megatron_fsdp=True, fsdp_keep_gathered=True, override_ddp_config={"nccl_ub": True})),
     r"^wrapper.fsdp_keep_gathered=True .*nccl_ub"),
    (dict(parallelism=Parallelism(data_parallel_replicate_size=2), wrapper=Wrapper(use_megatron_fsdp=True,
          override_ddp_config={"outer_dp_sharding_strategy": "optim"})), r"outer_dp_sharding_strategy='optim'"),
    (dict(parallelism=Parallelism(data_parallel_replicate_size=2, expert_model_parallel_size=2),
          wrapper=Wrapper(use_megatron_fsdp=True)), r"^parallelism.data_parallel_replicate_size=2 .*MoE experts"),
    (dict(parallelism=Parallelism(data_parallel_replicate_size=2), wrapper=Wrapper(use_distributed_optimizer=False)),
     r"^parallelism.data_parallel_replicate_size=2 .*without use_distributed_optimizer"),
]


@pytest.mark.parametrize("kwargs, named", BAD_WHEN_MADE, ids=[f"{i}-{next(iter(k))}" for i, (k, _) in enumerate(BAD_WHEN_MADE)])
def test_engine_config_names_a_bad_value_when_made(kwargs, named):
    """Issue 51: EngineConfig accepted 30 bad values and named them only in validate() or runtime.init. Issue 52:
    every check that needs only the fields runs when the config is made."""
    with pytest.raises(ConfigError, match=named):
        EngineConfig(**kwargs)


def test_what_needs_the_machine_or_the_world_waits_for_validate():
    """Made on a CPU-only notebook kernel for GPU engines: NCCL-only options and world sizes are checked later."""
    gpu_only = EngineConfig(communication=Communication(high_priority_comm=True, nccl_max_ctas=8),
                            parallelism=Parallelism(tensor_model_parallel_size=2))
    gpu_only.validate(world_size=2, on_gpu=True)
    with pytest.raises(ConfigError, match="communication.high_priority_comm=True .*without a GPU"):
        gpu_only.validate(on_gpu=False)
    with pytest.raises(ConfigError, match="world_size"):
        gpu_only.validate(world_size=3, on_gpu=True)
    cfg = EngineConfig()
    cfg.parallelism.tensor_model_parallel_size = 0   # changed after it was made: validate() still names it
    with pytest.raises(ConfigError, match="^parallelism.tensor_model_parallel_size=0"):
        cfg.validate(on_gpu=False)
