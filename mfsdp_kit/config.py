"""Configs: what to build and how to shard it.

`EngineConfig` says how a model is parallelised and wrapped; `OptimConfig` how it is
optimised. `ddp_config(cfg)` turns an `EngineConfig` into megatron's
`DistributedDataParallelConfig` the way verl's Megatron-FSDP mode does: FSDP defaults
first, then `override_ddp_config` wins. Every check runs in `validate()`, before any
process group or GPU work, and names the field, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from . import lora as _lora
from .fieldtypes import ConfigError, bad_value, check_field_types, field_types, finite, is_int, type_error  # noqa: F401

DTYPES = ("bf16", "fp16", "fp32")
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
ATTENTION_BACKENDS = ("local", "sdpa", "flex")
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


@dataclass(kw_only=True)
class EngineConfig:
    """How the model is parallelised, wrapped (DDP or Megatron-FSDP) and in which precision."""

    tensor_model_parallel_size: int = 1
    """Ranks that split each layer's matrices (megatron TP)."""
    pipeline_model_parallel_size: int = 1
    """Ranks that split the layer stack into stages (megatron PP). Not with Megatron-FSDP."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (interleaved schedule); None = one chunk."""
    context_parallel_size: int = 1
    """Ranks that split the sequence (megatron CP)."""
    expert_model_parallel_size: int = 1
    """Ranks that split an MoE layer's experts (megatron EP): each holds num_experts / EP of them and
    tokens travel to their experts by all-to-all. EP groups are carved out of the data-parallel
    ranks, so it must divide tensor*context*data-parallel ranks; expert weights are then sharded
    (FSDP) or all-reduced (DDP) over the remaining expert-data-parallel ranks only."""
    use_megatron_fsdp: bool = False
    """Wrap with Megatron-FSDP (ZeRO-3: params, grads and optimizer state sharded) instead of DDP."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1). Required by Megatron-FSDP."""
    override_ddp_config: dict = field(default_factory=dict)
    """Fields of megatron's DistributedDataParallelConfig that win over the kit's defaults."""
    override_transformer_config: dict = field(default_factory=dict)
    """Fields of megatron's TransformerConfig set on the model provider before it is built."""
    dtype: str = "fp32"
    """Compute dtype: "bf16" | "fp16" | "fp32". Main weights and optimizer state stay fp32."""
    attention_backend: str = "local"
    """Core attention: "local" (megatron's DotProductAttention) | "sdpa" (torch's fused kernels; packed rows
    one SDPA per sequence) | "flex" ("sdpa", packed rows through one flex_attention: GPU for training)."""
    recompute: str = "none"
    """Activation recompute: "none" | "selective" (core attention) | "full" (whole layers)."""
    fused_kernels: bool = False
    """Fuse RoPE and SwiGLU (forward and backward) with torch.compile, as TE would (`models.fusions`): megatron's
    local spec runs them unfused. The first step compiles. Measured: docs/benchmarks.md, "throughput" and
    "levers, fourth set"."""
    fused_cross_entropy: bool = False
    """The loss's cross-entropy in compiled kernels that read the logits in their own dtype
    (`models.cross_entropy`) instead of megatron's unfused one, which copies the [tokens, vocab] logits to
    fp32 (4 B x tokens x vocabulary / TP per micro-batch) and passes over the copy several times.
    Replaces the model's `compute_language_model_loss` (so it also wins over `cross_entropy_loss_fusion`).
    Measured: docs/benchmarks.md, "levers, fourth set". Off by default like `fused_kernels`: the first step
    compiles (seconds), more than a tiny model's run gains."""
    fsdp_all_gather_group: bool = False
    """Megatron-FSDP's parameter all-gathers on an NCCL communicator of their own (megatron's
    `create_all_gather_group`): one communicator runs its collectives in issue order, so a shared one
    makes the next layer's gather wait behind queued gradient reduce-scatters. Costs one communicator."""
    fsdp_keep_gathered: bool = False
    """Keep each FSDP unit's all-gathered weights from its first gather in a step to the end of the step's backward
    (`keep_gathered`; FSDP2's `reshard_after_forward=False`): one all-gather per unit per step instead of two per
    micro-batch, same numbers. Costs the whole model's weights in the compute dtype (2 B/param in bf16, not divided
    by N) through forward and backward. Megatron-FSDP with optim_grads_params and its default allocator only."""
    high_priority_comm: bool = False
    """Data-parallel collectives on high-priority CUDA streams (megatron's `high_priority_stream_groups`
    = ["dp_cp"]): their kernels are scheduled ahead of queued compute kernels. GPU (NCCL) only."""
    nccl_max_ctas: int | None = None
    """Most thread blocks (CTAs, one SM each) a data-parallel NCCL collective may run on (megatron's per-communicator
    `max_ctas`, groups dp_cp and dp; NCCL's Hopper default is 32 of 132 SMs). Collectives that overlap compute take
    their SMs from the GEMMs beside them; fewer CTAs leave the GEMMs more, and make each collective slower.
    None: NCCL's choice. GPU (NCCL) only."""
    seed: int = 1234
    """Seed for parameter init and the per-rank RNG tracker."""
    optimizer_offload: bool = False
    """Keep Adam's exp_avg/exp_avg_sq and the fp32 main weights in (pinned) host memory between
    steps, streamed to the device only for `optimizer.step()` (the kit's `offload.stream_optimizer`,
    applied by `offload.apply_config`; megatron-core 0.16.1's optimizer_cpu_offload fails with
    Megatron-FSDP on DTensor shards). Saves 12 B/param / N on the device, costs 24 B/param / N of
    host<->device copies per step. For all state between steps use `offload.offload`/`reload`."""
    lora: _lora.LoRAConfig | None = None
    """Train LoRA adapters only (`lora.LoRAConfig`), the loaded base frozen; None = train every weight."""

    # ---- derived views -------------------------------------------------------------------
    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // self.model_parallel_size

    # ---- validation ----------------------------------------------------------------------
    def validate(self, world_size: int | None = None, on_gpu: bool | None = None) -> "EngineConfig":
        """Raise `ConfigError` naming the bad field; return self so calls chain."""
        check_field_types(self)   # a bool is not a size, "no" is not False, "abc" is not a seed
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size"):
            value = getattr(self, name)
            if value < 1:
                raise bad_value(name, value, "a positive integer")
        if not 0 <= self.seed < 2**63:
            raise bad_value("seed", self.seed, "an integer in [0, 2**63)")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp < 1:
            raise bad_value("virtual_pipeline_model_parallel_size", vpp, "None or a positive integer")
        if vpp is not None and vpp > 1 and self.pipeline_model_parallel_size == 1:
            raise bad_value("virtual_pipeline_model_parallel_size", vpp,
                       "None or 1 when pipeline_model_parallel_size == 1 (virtual stages interleave pipeline stages)")
        if self.dtype not in DTYPES:
            raise bad_value("dtype", self.dtype, " | ".join(DTYPES))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise bad_value("attention_backend", self.attention_backend, " | ".join(ATTENTION_BACKENDS))
        if self.recompute not in RECOMPUTE:
            raise bad_value("recompute", self.recompute, " | ".join(RECOMPUTE))
        if self.use_megatron_fsdp and not self.use_distributed_optimizer:
            raise bad_value("use_distributed_optimizer", False,
                       "True when use_megatron_fsdp=True (Megatron-FSDP steps its shards with the distributed optimizer)")
        if self.use_megatron_fsdp and self.pipeline_model_parallel_size > 1:
            raise bad_value("pipeline_model_parallel_size", self.pipeline_model_parallel_size,
                       "1 when use_megatron_fsdp=True: megatron-core 0.16.1's Megatron-FSDP adapter shards one "
                       "model chunk over data-parallel ranks and does not implement pipeline-parallel stages; "
                       "use DDP for pipeline parallelism")
        _validate_overrides("override_ddp_config", self.override_ddp_config, _ddp_types(), DDP_RANGES)
        _validate_overrides("override_transformer_config", self.override_transformer_config, _transformer_types(),
                            TRANSFORMER_RANGES)
        _validate_expert_overrides(self)
        _lora.check(lora=self.lora)
        strategy = self.override_ddp_config.get("data_parallel_sharding_strategy")
        if strategy is not None and strategy not in SHARDING_STRATEGIES:
            raise bad_value("override_ddp_config.data_parallel_sharding_strategy", strategy, " | ".join(SHARDING_STRATEGIES))
        if world_size is not None and world_size % self.model_parallel_size:
            raise bad_value("world_size", world_size,
                       f"a multiple of tensor*pipeline*context parallel sizes = {self.tensor_model_parallel_size}"
                       f"*{self.pipeline_model_parallel_size}*{self.context_parallel_size} = {self.model_parallel_size}")
        if world_size is not None:
            _validate_expert_world(self, world_size)
        on_gpu = _cuda_available() if on_gpu is None else on_gpu
        if self.use_megatron_fsdp and on_gpu and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            raise bad_value("CUDA_DEVICE_MAX_CONNECTIONS", "1",
                       "unset or > 1 with use_megatron_fsdp=True (Megatron's rule: FSDP overlaps communication "
                       "with compute on several CUDA streams)")
        if self.override_ddp_config.get("preserve_fp32_weights") is False and self.dtype != "fp32":
            raise bad_value("override_ddp_config.preserve_fp32_weights", False, f"True with dtype={self.dtype!r}: "
                            "megatron-core 0.16.1 clips fp32 grads only (optimizer/clip_grads.py:167 asserts)")
        if self.fsdp_keep_gathered:
            _validate_keep_gathered(self)
        from . import hsdp
        hsdp.validate(self, world_size=world_size, on_gpu=on_gpu)
        if self.high_priority_comm and not on_gpu:
            raise bad_value("high_priority_comm", True, "False without a GPU (an NCCL process-group option)")
        if self.nccl_max_ctas is not None and not 1 <= self.nccl_max_ctas <= NCCL_MAX_CTAS:
            raise bad_value("nccl_max_ctas", self.nccl_max_ctas, f"None or an integer in [1, {NCCL_MAX_CTAS}]")
        if self.nccl_max_ctas is not None and not on_gpu:
            raise bad_value("nccl_max_ctas", self.nccl_max_ctas, "None without a GPU (an NCCL communicator option)")
        for key in [k for k in GPU_ONLY_DDP_KEYS if self.override_ddp_config.get(k) and not on_gpu]:
            raise bad_value(f"override_ddp_config.{key}", True, "False without a GPU (CUDA memory pools: "
                            "megatron_fsdp/param_and_grad_buffer.py, FixedPoolAllocator)")
        return self

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        names = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in names:
                raise bad_value(f"EngineConfig.{key}", d[key], f"one of the fields {names}")
        lora = d.get("lora")
        return cls(**{**d, "lora": _lora.LoRAConfig(**lora) if isinstance(lora, dict) else lora})

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
    kwargs: dict[str, Any] = dict(use_distributed_optimizer=cfg.use_distributed_optimizer)
    if cfg.use_megatron_fsdp:
        kwargs.update(FSDP_DDP_DEFAULTS)
        if not _cuda_available():
            # gloo has no PREMUL_SUM reduce op (megatron_fsdp/param_and_grad_buffer.py:4748).
            # The overlap flags are asked off, but Megatron-FSDP turns them back on when it fully
            # shards (megatron_fsdp.py:274-279): compat.cpu makes its coalesced all-gathers
            # synchronous, and engine.settle_param_gathers waits on any it leaves pending.
            kwargs.update(gradient_reduce_div_fusion=False, overlap_grad_reduce=False, overlap_param_gather=False)
    kwargs.update(cfg.override_ddp_config)
    return DistributedDataParallelConfig(**kwargs)


# ---- helpers -------------------------------------------------------------------------------
def _validate_keep_gathered(cfg: EngineConfig) -> None:
    """fsdp_keep_gathered holds what optim_grads_params would free, in buckets of megatron's default allocator."""
    strategy = cfg.override_ddp_config.get("data_parallel_sharding_strategy", "optim_grads_params")
    if not cfg.use_megatron_fsdp or strategy != "optim_grads_params":
        raise bad_value("fsdp_keep_gathered", True, "False unless use_megatron_fsdp=True with data_parallel_sharding_"
                        f"strategy 'optim_grads_params' (got use_megatron_fsdp={cfg.use_megatron_fsdp}, {strategy!r}): "
                        "only then are gathered weights freed between forward and backward")
    for key in [k for k in GPU_ONLY_DDP_KEYS if cfg.override_ddp_config.get(k)]:
        raise bad_value("fsdp_keep_gathered", True, f"False with override_ddp_config.{key}=True: megatron's double "
                        "buffer has two bucket slots for all units, so it cannot keep every unit gathered")


EXPERT_LAYOUT_KEYS = ("expert_model_parallel_size", "expert_tensor_parallel_size")
"""TransformerConfig fields that must agree with the process groups `runtime.init` builds: a model
built with EP 2 over groups of EP 1 routes tokens to experts no rank holds."""


def _validate_expert_overrides(cfg: EngineConfig) -> None:
    """One path to expert parallelism: the EngineConfig field, never the transformer override."""
    for key in EXPERT_LAYOUT_KEYS:
        if key in cfg.override_transformer_config:
            allowed = ("absent: set EngineConfig.expert_model_parallel_size instead (runtime.init builds the "
                       "expert-parallel groups from it and the model config follows)" if key.startswith("expert_model")
                       else "absent: the expert tensor-parallel size is tensor_model_parallel_size (the kit's "
                            "runtime builds expert groups with megatron's default)")
            raise bad_value(f"override_transformer_config.{key}", cfg.override_transformer_config[key], allowed)


def _validate_expert_world(cfg: EngineConfig, world_size: int) -> None:
    """megatron carves EP groups out of the tp*cp*dp ranks of a pipeline stage
    (parallel_state.initialize_model_parallel: world % (etp*ep*pp), here etp = tp)."""
    ep = cfg.expert_model_parallel_size
    if ep == 1 or world_size % cfg.model_parallel_size:
        return
    per_stage = cfg.tensor_model_parallel_size * cfg.context_parallel_size * cfg.data_parallel_size(world_size)
    if per_stage % (cfg.tensor_model_parallel_size * ep):
        raise bad_value("expert_model_parallel_size", ep,
                        f"a size with tensor_model_parallel_size * expert_model_parallel_size dividing the "
                        f"{per_stage} tensor*context*data-parallel ranks of a pipeline stage (world_size="
                        f"{world_size})")


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


@functools.cache
def _ddp_types() -> dict[str, tuple[Any, Any]]:
    from megatron.core.distributed import DistributedDataParallelConfig
    return field_types(DistributedDataParallelConfig)


@functools.cache
def _transformer_types() -> dict[str, tuple[Any, Any]]:
    from megatron.core.transformer import TransformerConfig
    return field_types(TransformerConfig)


def _at_least(lo: int, *, none_ok: bool = False) -> tuple[Callable[[Any], bool], str]:
    """For integer fields (the type check runs first)."""
    return (lambda v: v >= lo), (f"None or an integer >= {lo}" if none_ok else f"an integer >= {lo}")


def _probability() -> tuple[Callable[[Any], bool], str]:
    return (lambda v: 0 <= v <= 1), "a number in [0, 1]"


def _positivefinite() -> tuple[Callable[[Any], bool], str]:
    return (lambda v: finite(v) and v > 0), "a finite number > 0"


DDP_RANGES = dict(
    bucket_size=_at_least(1, none_ok=True),                    # elements per gradient bucket
    num_distributed_optimizer_instances=_at_least(1),
    suggested_communication_unit_size=_at_least(1, none_ok=True),
)
"""Ranges of override_ddp_config values (checked after the type; None passes where it is the default)."""
TRANSFORMER_RANGES = dict(
    num_layers=_at_least(1), hidden_size=_at_least(1), num_attention_heads=_at_least(1),
    num_query_groups=_at_least(1, none_ok=True), ffn_hidden_size=_at_least(1, none_ok=True),
    kv_channels=_at_least(1, none_ok=True), hidden_dropout=_probability(), attention_dropout=_probability(),
    layernorm_epsilon=_positivefinite(), init_method_std=_positivefinite(),
)
"""Ranges of override_transformer_config values where the sane range is obvious."""


def _validate_overrides(field_name: str, overrides: dict, types_: dict[str, tuple[Any, Any]],
                        ranges: dict[str, tuple[Callable[[Any], bool], str]]) -> None:
    """Known keys only (with close matches), each value of the megatron field's type and in its range."""
    if not isinstance(overrides, dict):
        raise bad_value(field_name, overrides, "a dict of field -> value")
    allowed = list(types_)
    for key, value in overrides.items():
        if key not in types_:
            close = difflib.get_close_matches(key, allowed, n=3)
            hint = f"did you mean {close}?" if close else f"see the {len(allowed)} fields of the megatron config"
            raise ConfigError(f"{field_name}: unknown key {key!r}; {hint} (allowed: {', '.join(sorted(allowed))})")
        tp, default = types_[key]
        if err := type_error(f"{field_name}.{key}", value, tp, default):
            raise err
        if key in ranges and value is not None and not ranges[key][0](value):
            raise bad_value(f"{field_name}.{key}", value, ranges[key][1])
