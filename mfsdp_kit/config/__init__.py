"""Configs: what to build and how to shard it.

`EngineConfig` says how a model is parallelised and wrapped, in sections (torchtitan's job config:
`config.sections`): `parallelism`, `wrapper`, `kernels`, `communication`, `offload`, with the model's
numerics (dtype, recompute, seed, TransformerConfig overrides) and `lora` beside them. `OptimConfig` says
how it is optimised. `ddp_config(cfg)` turns an `EngineConfig` into megatron's
`DistributedDataParallelConfig` the way verl's Megatron-FSDP mode does: FSDP defaults first, then
`wrapper.override_ddp_config` wins, and HSDP's instances come from `parallelism.data_parallel_replicate_size`.
Every check runs in `validate()`, before any process group or GPU work, and names the field (its path),
the value and what is allowed; the rank arithmetic is `parallel_dims.ParallelDims`'s. `EngineConfig(...)` runs
them when made (like `OptimConfig`), but for those that need the machine or the world size.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any

from . import overrides
from .flat import FLAT_NAMES, accept_flat, hsdp_from_override
from .sections import SECTIONS, Communication, Kernels, LoRAConfig, Offload, Parallelism, Wrapper  # noqa: F401
from .sections import check_lora
from ..fieldtypes import ConfigError, bad_value, check_field_types, field_types, finite, is_int, type_error  # noqa: F401
from .parallel_dims import ParallelDims, check_sizes

DTYPES = ("bf16", "fp16", "fp32")
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
ATTENTION_BACKENDS = ("auto", "local", "sdpa", "flex")
FUSION_KERNELS = ("auto", "torch", "triton")
"""`kernels.fusion_kernels`: "triton" where it runs, else "torch" | torch.compile of `models.fusions`' functions |
`models.triton_fusions`' kernels."""
BACKENDS = ("auto", "nccl", "gloo")
"""torch.distributed backends `runtime.init` and `cluster.start` accept ("auto": nccl with GPUs, else gloo)."""
RECOMPUTE = ("none", "selective", "full")
ADAM_IMPLEMENTATIONS, GPU_ONLY_DDP_KEYS = ("auto", "foreach", "fused"), ("fsdp_double_buffer", "nccl_ub")
GRAD_UPCASTS = ("by_part", "whole")
NCCL_MAX_CTAS = 32
"""NCCL's MAXCHANNELS: the most CTAs one collective can use (ncclConfig_t.maxCTAs is checked against it)."""

# What verl's Megatron-FSDP mode sets before the user's overrides (verl PR #5423).
FSDP_DDP_DEFAULTS = dict(
    use_distributed_optimizer=True,
    check_for_nan_in_grad=True,
    use_megatron_fsdp=True,
    data_parallel_sharding_strategy="optim_grads_params",
    overlap_grad_reduce=True,
)


@accept_flat
@dataclass(kw_only=True)
class EngineConfig:
    """How the model is parallelised, wrapped (DDP or Megatron-FSDP) and in which precision: one section per
    concern (`config.sections`), the model's numerics at the top. The old flat names work until mfsdp_kit 0.2.0
    (`config.flat`), each use with a DeprecationWarning: `EngineConfig(tensor_model_parallel_size=2)` sets
    `parallelism.tensor_model_parallel_size`, and `cfg.tensor_model_parallel_size` reads it."""

    parallelism: Parallelism = field(default_factory=Parallelism)
    """Data replicate / shard (HSDP), tensor, pipeline, context and expert sizes (arithmetic: `parallel_dims`)."""
    wrapper: Wrapper = field(default_factory=Wrapper)
    """DDP or Megatron-FSDP, the distributed optimizer, megatron's DDP-config overrides (sharding strategy)."""
    kernels: Kernels = field(default_factory=Kernels)
    """Core attention backend, compiled RoPE/SwiGLU, the compiled cross-entropy."""
    communication: Communication = field(default_factory=Communication)
    """NCCL tuning of the data-parallel collectives."""
    offload: Offload = field(default_factory=Offload)
    """Optimizer state in host memory between steps."""
    dtype: str = "fp32"
    """Compute dtype: "bf16" | "fp16" | "fp32". Main weights and optimizer state stay fp32."""
    recompute: str = "none"
    """Activation recompute: "none" | "selective" (core attention) | "full" (whole layers)."""
    override_transformer_config: dict = field(default_factory=dict)
    """Fields of megatron's TransformerConfig set on the model provider before it is built."""
    seed: int = 1234
    """Seed for parameter init and the per-rank RNG tracker."""
    lora: LoRAConfig | None = None
    """Train LoRA adapters only (`lora.LoRAConfig`, defined in `config.sections`), the loaded base frozen; None =
    train every weight."""

    def __post_init__(self):
        hsdp_from_override(self, stacklevel=4)   # the user's frame: __post_init__ < __init__ < accept_flat's
        self._check(on_gpu=None)   # when made, as OptimConfig: a bad value is named where it was written

    # ---- derived views (the arithmetic is ParallelDims') ----------------------------------
    @property
    def model_parallel_size(self) -> int:
        """tp x pp x cp, what any world must be a multiple of (`ParallelDims.model_parallel`, without a world)."""
        p = self.parallelism
        return p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        return self.parallel_dims(world_size).dp

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """The rank arithmetic of this layout over `world_size` ranks (`ConfigError` if it does not fit)."""
        return ParallelDims.of(self.parallelism, world_size=world_size)

    # ---- validation ----------------------------------------------------------------------
    def validate(self, world_size: int | None = None, on_gpu: bool | None = None) -> "EngineConfig":
        """Raise `ConfigError` naming the bad field (by its path: `parallelism.context_parallel_size`); return
        self so calls chain. Construction runs the same checks but those of a machine (`on_gpu`: the NCCL-only
        options, HSDP under DDP, CUDA_DEVICE_MAX_CONNECTIONS) and of a world (`world_size`): a config may be made
        on a CPU-only notebook kernel for GPU engines. Fields changed after construction are checked here."""
        on_gpu = _cuda_available() if on_gpu is None else on_gpu
        self._check(on_gpu=on_gpu)
        if world_size is not None:
            self.parallel_dims(world_size)   # world, experts and HSDP instances divide as megatron needs
        if self.wrapper.use_megatron_fsdp and on_gpu and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            raise bad_value("CUDA_DEVICE_MAX_CONNECTIONS", "1",
                       "unset or > 1 with use_megatron_fsdp=True (Megatron's rule: FSDP overlaps communication "
                       "with compute on several CUDA streams)")
        return self

    def _check(self, *, on_gpu: bool | None) -> None:
        """Every check of one config on its own; `on_gpu=None`: without those that need to know the machine."""
        gpu = True if on_gpu is None else on_gpu   # None: what only a GPU allows is not refused yet
        for name, cls in SECTIONS.items():   # a bool is not a size, "no" is not False, "abc" is not a seed
            if not isinstance(getattr(self, name), cls):
                raise bad_value(name, getattr(self, name), f"a config.sections.{cls.__name__}")
            check_field_types(getattr(self, name), prefix=f"{name}.")
        check_field_types(self)
        par, wrap = self.parallelism, self.wrapper
        check_sizes({f"parallelism.{name}": getattr(par, name) for name in (
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
            "expert_model_parallel_size", "data_parallel_replicate_size")}, shard=par.data_parallel_shard_size)
        if not 0 <= self.seed < 2**63:
            raise bad_value("seed", self.seed, "an integer in [0, 2**63)")
        vpp = par.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp < 1:
            raise bad_value("parallelism.virtual_pipeline_model_parallel_size", vpp, "None or a positive integer")
        if vpp is not None and vpp > 1 and par.pipeline_model_parallel_size == 1:
            raise bad_value("parallelism.virtual_pipeline_model_parallel_size", vpp,
                       "None or 1 when pipeline_model_parallel_size == 1 (virtual stages interleave pipeline stages)")
        for name, value, allowed in (("dtype", self.dtype, DTYPES), ("recompute", self.recompute, RECOMPUTE),
                                     ("kernels.attention_backend", self.kernels.attention_backend, ATTENTION_BACKENDS),
                                     ("kernels.fusion_kernels", self.kernels.fusion_kernels, FUSION_KERNELS)):
            if value not in allowed:
                raise bad_value(name, value, " | ".join(allowed))
        if wrap.use_megatron_fsdp and not wrap.use_distributed_optimizer:
            raise bad_value("wrapper.use_distributed_optimizer", False,
                       "True when use_megatron_fsdp=True (Megatron-FSDP steps its shards with the distributed optimizer)")
        if wrap.use_megatron_fsdp and par.pipeline_model_parallel_size > 1:
            raise bad_value("parallelism.pipeline_model_parallel_size", par.pipeline_model_parallel_size,
                       "1 when use_megatron_fsdp=True: megatron-core 0.16.1's Megatron-FSDP adapter shards one "
                       "model chunk over data-parallel ranks and does not implement pipeline-parallel stages; "
                       "use DDP for pipeline parallelism")
        overrides.check(override_ddp_config=wrap.override_ddp_config,
                               override_transformer_config=self.override_transformer_config)
        check_lora(lora=self.lora)
        strategy = wrap.override_ddp_config.get("data_parallel_sharding_strategy")
        if strategy is not None and strategy not in SHARDING_STRATEGIES:
            raise bad_value("wrapper.override_ddp_config.data_parallel_sharding_strategy", strategy,
                            " | ".join(SHARDING_STRATEGIES))
        if wrap.override_ddp_config.get("preserve_fp32_weights") is False and self.dtype != "fp32":
            raise bad_value("wrapper.override_ddp_config.preserve_fp32_weights", False, f"True with dtype="
                            f"{self.dtype!r}: megatron-core 0.16.1 clips fp32 grads only (optimizer/clip_grads.py:167 "
                            "asserts)")
        if wrap.fsdp_keep_gathered:
            _validate_keep_gathered(self)
        from . import hsdp
        hsdp.validate(self, on_gpu=gpu)
        _validate_communication(self.communication, on_gpu=gpu)
        for key in [k for k in GPU_ONLY_DDP_KEYS if wrap.override_ddp_config.get(k) and not gpu]:
            raise bad_value(f"wrapper.override_ddp_config.{key}", True, "False without a GPU (CUDA memory pools: "
                            "megatron_fsdp/param_and_grad_buffer.py, FixedPoolAllocator)")

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        """From `to_dict`'s nested dict, or a flat one written before the sections (each flat key warns)."""
        names = [f.name for f in dataclasses.fields(cls)]
        kwargs = dict(d)
        for key, value in d.items():
            if key not in names and key not in FLAT_NAMES:
                close = difflib.get_close_matches(key, names + list(FLAT_NAMES), n=3)
                raise bad_value(f"EngineConfig.{key}", value, f"one of the fields {names}"
                                + (f"; did you mean {close}?" if close else ""))
            if key in SECTIONS and isinstance(value, dict):
                kwargs[key] = _section_from_dict(key, value)
        if isinstance(kwargs.get("lora"), dict):
            kwargs["lora"] = LoRAConfig(**kwargs["lora"])
        return cls(**kwargs)

    def to_yaml(self, path: str | None = None) -> str:
        import yaml
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path:
            with open(path, "w") as f:
                f.write(text)
        return text

    @classmethod
    def from_yaml(cls, path_or_text: str) -> "EngineConfig":
        import yaml
        text = open(path_or_text).read() if os.path.exists(path_or_text) else path_or_text
        return cls.from_dict(yaml.safe_load(text) or {})


@dataclass(kw_only=True)
class OptimConfig:
    """How the model is optimised (megatron's OptimizerConfig, reduced to what a researcher tunes)."""

    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to `lr`."""
    decay_steps: int | None = None
    """Steps of cosine decay after warm-up; None = constant after warm-up."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Max global grad norm (0 = no clipping)."""
    adam_implementation: str = "auto"
    """torch Adam(W)'s kernels (megatron-core 0.16.1 passes no `fused=`): "auto" = "fused" if every param is on a
    GPU, else torch's choice (CPU unchanged) | "foreach" | "fused". Fused kernels lower the optimizer step's peak
    and raise tokens/s on GPUs (docs/benchmarks.md, "levers")."""
    grad_upcast: str = "by_part"
    """How Megatron-FSDP's step gets fp32 grads for Adam from its bf16 grad shard: "by_part" (`grad_upcast`: a part of
    fp32 copies at a time inside the step, `grad_upcast.PART_BYTES`; the same bits) | "whole" (megatron-core 0.16.1: the whole shard
    copied when backward ends and held through the step, +4 B per local element at the step's peak). Nothing
    changes under DDP or with fp32 grads. by_part is the default because it is bit-equal, lowers the optimizer
    step's peak and raises the largest model that fits (docs/benchmarks.md, "levers, seventh set")."""

    def __post_init__(self):
        self.validate()   # when made, as a bad value is made: not at build_optimizer, after the model exists

    def validate(self) -> "OptimConfig":
        """Raise `ConfigError` naming the bad field: the ranges Adam and the scheduler make sense in.

        Each of these once trained silently wrong: lr=inf or clip_grad=nan poison the weights,
        decay_steps < 1 trains at lr 0, min_lr > lr decays upwards."""
        check_field_types(self)
        for name, ok, allowed in (
                ("lr", finite(self.lr) and self.lr > 0, "a finite number > 0"),
                ("min_lr", finite(self.min_lr) and 0 <= self.min_lr <= self.lr, f"a number in [0, lr={self.lr}]"),
                ("warmup_steps", self.warmup_steps >= 0, "an integer >= 0"),
                ("decay_steps", self.decay_steps is None or self.decay_steps >= 1, "None or an integer >= 1"),
                ("weight_decay", finite(self.weight_decay) and self.weight_decay >= 0, "a finite number >= 0"),
                ("adam_beta1", 0 <= self.adam_beta1 < 1, "a number in [0, 1)"),
                ("adam_beta2", 0 <= self.adam_beta2 < 1, "a number in [0, 1)"),
                ("adam_eps", finite(self.adam_eps) and self.adam_eps > 0, "a finite number > 0"),
                ("clip_grad", finite(self.clip_grad) and self.clip_grad >= 0, "a finite number >= 0 (0 = no clipping)"),
                ("adam_implementation", self.adam_implementation in ADAM_IMPLEMENTATIONS,
                 " | ".join(ADAM_IMPLEMENTATIONS)),
                ("grad_upcast", self.grad_upcast in GRAD_UPCASTS, " | ".join(GRAD_UPCASTS))):
            if not ok:
                raise bad_value(name, getattr(self, name), allowed)
        return self


def ddp_config(cfg: EngineConfig):
    """megatron `DistributedDataParallelConfig` for `cfg`: FSDP defaults, then the user's overrides."""
    from megatron.core.distributed import DistributedDataParallelConfig

    cfg.validate()
    kwargs: dict[str, Any] = dict(use_distributed_optimizer=cfg.wrapper.use_distributed_optimizer)
    if cfg.parallelism.data_parallel_replicate_size > 1:   # HSDP (hsdp.py); megatron's default is 1
        kwargs.update(num_distributed_optimizer_instances=cfg.parallelism.data_parallel_replicate_size)
    if cfg.wrapper.use_megatron_fsdp:
        kwargs.update(FSDP_DDP_DEFAULTS)
        if not _cuda_available():
            # gloo has no PREMUL_SUM reduce op (megatron_fsdp/param_and_grad_buffer.py:4748).
            # The overlap flags are asked off, but Megatron-FSDP turns them back on when it fully
            # shards (megatron_fsdp.py:274-279): compat.patches.cpu makes its coalesced all-gathers
            # synchronous, and engine.settle_param_gathers waits on any it leaves pending.
            kwargs.update(gradient_reduce_div_fusion=False, overlap_grad_reduce=False, overlap_param_gather=False)
    kwargs.update(cfg.wrapper.override_ddp_config)
    return DistributedDataParallelConfig(**kwargs)


# ---- helpers -------------------------------------------------------------------------------
def _section_from_dict(name: str, values: dict):
    cls = SECTIONS[name]
    fields = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=3)
            raise bad_value(f"EngineConfig.{name}.{key}", values[key], f"one of the fields {fields}"
                            + (f"; did you mean {close}?" if close else ""))
    return cls(**values)


def _validate_keep_gathered(cfg: EngineConfig) -> None:
    """fsdp_keep_gathered holds what optim_grads_params would free, in buckets of megatron's default allocator."""
    wrap = cfg.wrapper
    strategy = wrap.override_ddp_config.get("data_parallel_sharding_strategy", "optim_grads_params")
    if not wrap.use_megatron_fsdp or strategy != "optim_grads_params":
        raise bad_value("wrapper.fsdp_keep_gathered", True, "False unless use_megatron_fsdp=True with data_parallel_"
                        f"sharding_strategy 'optim_grads_params' (got use_megatron_fsdp={wrap.use_megatron_fsdp}, "
                        f"{strategy!r}): only then are gathered weights freed between forward and backward")
    for key in [k for k in GPU_ONLY_DDP_KEYS if wrap.override_ddp_config.get(k)]:
        raise bad_value("wrapper.fsdp_keep_gathered", True, f"False with override_ddp_config.{key}=True: megatron's "
                        "double buffer has two bucket slots for all units, so it cannot keep every unit gathered")


def _validate_communication(comm: Communication, *, on_gpu: bool) -> None:
    """The collective timeout; NCCL options: each needs a GPU, and max_ctas NCCL's range."""
    if not is_int(comm.collective_timeout_s) or comm.collective_timeout_s < 1:
        raise bad_value("communication.collective_timeout_s", comm.collective_timeout_s, "an integer >= 1 (seconds)")
    if comm.high_priority_comm and not on_gpu:
        raise bad_value("communication.high_priority_comm", True, "False without a GPU (an NCCL process-group option)")
    if comm.nccl_max_ctas is not None and not 1 <= comm.nccl_max_ctas <= NCCL_MAX_CTAS:
        raise bad_value("communication.nccl_max_ctas", comm.nccl_max_ctas,
                        f"None or an integer in [1, {NCCL_MAX_CTAS}]")
    if comm.nccl_max_ctas is not None and not on_gpu:
        raise bad_value("communication.nccl_max_ctas", comm.nccl_max_ctas,
                        "None without a GPU (an NCCL communicator option)")


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()
