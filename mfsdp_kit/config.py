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
import os
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("bf16", "fp16", "fp32")
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
ATTENTION_BACKENDS = ("local", "sdpa")
RECOMPUTE = ("none", "selective", "full")

# What verl's Megatron-FSDP mode sets before the user's overrides (verl PR #5423).
FSDP_DDP_DEFAULTS = dict(
    use_distributed_optimizer=True,
    check_for_nan_in_grad=True,
    use_megatron_fsdp=True,
    data_parallel_sharding_strategy="optim_grads_params",
    overlap_grad_reduce=True,
)


class ConfigError(ValueError):
    """A config field holds a value that is not allowed; the message names both."""


def _bad(field_name: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{field_name}={value!r} is not allowed; allowed: {allowed}")


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
    """Core attention: "local" (megatron's DotProductAttention) | "sdpa" (torch's fused kernels)."""
    recompute: str = "none"
    """Activation recompute: "none" | "selective" (core attention) | "full" (whole layers)."""
    fused_kernels: bool = False
    """Fuse RoPE and SwiGLU (forward and backward) with torch.compile, as TE would (`models.fusions`):
    their unfused kernels are ~20 % of a GPU step on the local spec. The first step compiles."""
    seed: int = 1234
    """Seed for parameter init and the per-rank RNG tracker."""
    optimizer_offload: bool = False
    """Keep Adam's exp_avg/exp_avg_sq and the fp32 main weights in (pinned) host memory between
    steps, streamed to the device only for `optimizer.step()` (the kit's `offload.stream_optimizer`,
    applied by `offload.apply_config`; megatron-core 0.16.1's optimizer_cpu_offload fails with
    Megatron-FSDP on DTensor shards). Saves 12 B/param / N on the device, costs 24 B/param / N of
    host<->device copies per step. For all state between steps use `offload.offload`/`reload`."""

    # ---- derived views -------------------------------------------------------------------
    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // self.model_parallel_size

    # ---- validation ----------------------------------------------------------------------
    def validate(self, world_size: int | None = None, on_gpu: bool | None = None) -> "EngineConfig":
        """Raise `ConfigError` naming the bad field; return self so calls chain."""
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise _bad(name, value, "a positive integer")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and (not isinstance(vpp, int) or vpp < 1):
            raise _bad("virtual_pipeline_model_parallel_size", vpp, "None or a positive integer")
        if vpp is not None and vpp > 1 and self.pipeline_model_parallel_size == 1:
            raise _bad("virtual_pipeline_model_parallel_size", vpp,
                       "None or 1 when pipeline_model_parallel_size == 1 (virtual stages interleave pipeline stages)")
        if self.dtype not in DTYPES:
            raise _bad("dtype", self.dtype, " | ".join(DTYPES))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise _bad("attention_backend", self.attention_backend, " | ".join(ATTENTION_BACKENDS))
        if self.recompute not in RECOMPUTE:
            raise _bad("recompute", self.recompute, " | ".join(RECOMPUTE))
        if not isinstance(self.fused_kernels, bool):
            raise _bad("fused_kernels", self.fused_kernels, "True | False")
        if not isinstance(self.optimizer_offload, bool):
            raise _bad("optimizer_offload", self.optimizer_offload, "True | False")
        if self.use_megatron_fsdp and not self.use_distributed_optimizer:
            raise _bad("use_distributed_optimizer", False,
                       "True when use_megatron_fsdp=True (Megatron-FSDP steps its shards with the distributed optimizer)")
        if self.use_megatron_fsdp and self.pipeline_model_parallel_size > 1:
            raise _bad("pipeline_model_parallel_size", self.pipeline_model_parallel_size,
                       "1 when use_megatron_fsdp=True: megatron-core 0.16.1's Megatron-FSDP adapter shards one "
                       "model chunk over data-parallel ranks and does not implement pipeline-parallel stages; "
                       "use DDP for pipeline parallelism")
        _validate_overrides("override_ddp_config", self.override_ddp_config, _ddp_fields())
        _validate_overrides("override_transformer_config", self.override_transformer_config, _transformer_fields())
        strategy = self.override_ddp_config.get("data_parallel_sharding_strategy")
        if strategy is not None and strategy not in SHARDING_STRATEGIES:
            raise _bad("override_ddp_config.data_parallel_sharding_strategy", strategy, " | ".join(SHARDING_STRATEGIES))
        if world_size is not None and world_size % self.model_parallel_size:
            raise _bad("world_size", world_size,
                       f"a multiple of tensor*pipeline*context parallel sizes = {self.tensor_model_parallel_size}"
                       f"*{self.pipeline_model_parallel_size}*{self.context_parallel_size} = {self.model_parallel_size}")
        on_gpu = _cuda_available() if on_gpu is None else on_gpu
        if self.use_megatron_fsdp and on_gpu and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            raise _bad("CUDA_DEVICE_MAX_CONNECTIONS", "1",
                       "unset or > 1 with use_megatron_fsdp=True (Megatron's rule: FSDP overlaps communication "
                       "with compute on several CUDA streams)")
        return self

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        names = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in names:
                raise _bad(f"EngineConfig.{key}", d[key], f"one of the fields {names}")
        return cls(**d)

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

    def validate(self) -> "OptimConfig":
        if not self.lr > 0:
            raise _bad("lr", self.lr, "a positive float")
        if self.warmup_steps < 0:
            raise _bad("warmup_steps", self.warmup_steps, "an integer >= 0")
        if self.clip_grad < 0:
            raise _bad("clip_grad", self.clip_grad, "a float >= 0")
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
def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def _ddp_fields() -> list[str]:
    from megatron.core.distributed import DistributedDataParallelConfig
    return [f.name for f in dataclasses.fields(DistributedDataParallelConfig)]


def _transformer_fields() -> list[str]:
    from megatron.core.transformer import TransformerConfig
    return [f.name for f in dataclasses.fields(TransformerConfig)]


def _validate_overrides(field_name: str, overrides: dict, allowed: list[str]) -> None:
    if not isinstance(overrides, dict):
        raise _bad(field_name, overrides, "a dict of field -> value")
    for key in overrides:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=3)
            hint = f"did you mean {close}?" if close else f"see the {len(allowed)} fields of the megatron config"
            raise ConfigError(f"{field_name}: unknown key {key!r}; {hint} (allowed: {', '.join(sorted(allowed))})")
