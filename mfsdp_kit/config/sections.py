"""The sections of `EngineConfig`, one dataclass per concern (torchtitan's job config): how the ranks are laid
out, which wrapper shards what, which kernels run, how the collectives are tuned, what lives on the host.

Each field keeps the name it had when `EngineConfig` was one flat list (`tensor_model_parallel_size` is now
`parallelism.tensor_model_parallel_size`; `config.flat` maps the old spelling until it goes). Sections only hold
values: `EngineConfig` checks them when made and in `validate()` (the rank arithmetic in
`parallel_dims.ParallelDims`), naming a field by its path, e.g. `parallelism.context_parallel_size=0 is not
allowed; allowed: a positive integer`.

`LoRAConfig` (`EngineConfig.lora`, None by default) is the one section that checks itself when made: it is also made
alone (`lora.LoRAConfig(...)`, the name users type; `lora` re-exports it). It lives here, below the code that
applies it (`distributed.engine.add_adapters`, which `engine.build` and `models.hf.load` call), so `EngineConfig`
holds it without importing `lora/` (imports point down).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..fieldtypes import bad_value, check_field_types, finite


@dataclass(kw_only=True)
class Parallelism:
    """How the world's ranks are split: world = data_replicate x data_shard x tensor x pipeline ranks, where the
    data_shard ranks of one replica include the context-parallel ones (Megatron-FSDP shards over data x context)."""

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
    data_parallel_replicate_size: int = 1
    """HSDP (`hsdp.py`): replicas of the sharded state. The data x context ranks split into this many instances;
    Megatron-FSDP shards weights, grads and optimizer state within an instance (a node, on NVLink) and all-reduces
    each grad shard across instances once a step (megatron's `num_distributed_optimizer_instances`). 1 = plain
    Megatron-FSDP / distributed optimizer over all data-parallel ranks."""
    data_parallel_shard_size: int = -1
    """Ranks one replica shards over (its data x context ranks): -1 = what the world leaves, i.e.
    world / (tensor * pipeline * data_parallel_replicate_size). A positive value is checked against that."""


@dataclass(kw_only=True)
class Wrapper:
    """Which data-parallel wrapper holds the model, and what it shards."""

    use_megatron_fsdp: bool = False
    """Wrap with Megatron-FSDP (ZeRO-3: params, grads and optimizer state sharded) instead of DDP."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1). Required by Megatron-FSDP."""
    override_ddp_config: dict = field(default_factory=dict)
    """Fields of megatron's DistributedDataParallelConfig that win over the kit's defaults, e.g.
    {"data_parallel_sharding_strategy": "optim_grads"}. HSDP is `parallelism.data_parallel_replicate_size`."""
    fsdp_keep_gathered: bool = False
    """Keep each FSDP unit's all-gathered weights from its first gather in a step to the end of the step's backward
    (`keep_gathered`; FSDP2's `reshard_after_forward=False`): one all-gather per unit per step instead of two per
    micro-batch, same numbers. Costs the whole model's weights in the compute dtype (2 B/param in bf16, not divided
    by N) through forward and backward. Megatron-FSDP with optim_grads_params and its default allocator only."""


@dataclass(kw_only=True)
class Kernels:
    """Which kernels compute attention, the MLP's activation, RoPE and the loss."""

    attention_backend: str = "auto"
    """Core attention: "auto" ("sdpa" on a GPU, so batches are packed by default, unless the model has a sliding
    window; "local" on CPU: `models.support.attention_backend`) | "local" (megatron's DotProductAttention: padded
    batches only) | "sdpa" (torch's fused kernels; packed rows through varlen flash on a GPU, one SDPA per sequence
    on CPU) | "flex" ("sdpa", packed rows through one flex_attention: GPU for training)."""
    fused_kernels: bool | Literal["auto"] = "auto"
    """Fuse RoPE and SwiGLU (forward and backward) with torch.compile, as TE would (`models.fusions`): megatron's
    local spec runs them unfused. "auto": on a GPU, each that applies to the model (none on CPU, where the kit's
    checks compare megatron's own kernels) | True (an error if neither applies) | False. The first step compiles
    (seconds, once per process: sizes are symbolic). Measured: docs/benchmarks.md, "throughput", "levers, fourth
    set" and "grpo_iteration" (the update 1.9 -> 1.6 s)."""
    fusion_kernels: Literal["auto", "torch", "triton"] = "auto"
    """What computes the fused RoPE and SwiGLU of `fused_kernels`: "auto" ("triton" on a GPU that runs the kernels:
    `models.support.triton_available`, NVIDIA sm80+ with Triton; else "torch") | "torch" (torch.compile of the torch
    functions: `models.fusions`) | "triton" (the kit's Triton kernels, `models.triton_fusions`). Triton has no graph to
    trace: a fresh machine's first GRPO update is a few times faster than with "torch", later ones level within the
    runs' spread (measured: docs/benchmarks.md, "The Triton kernels by default").
    Dense MLPs only: MoE experts keep megatron's compiled SwiGLU. Process-wide: megatron's slots for them are module
    attributes, so the last model built chooses for every model of the process."""
    fused_cross_entropy: bool = False
    """The loss's cross-entropy in compiled kernels that read the logits in their own dtype
    (`distributed.cross_entropy`) instead of megatron's unfused one, which copies the [tokens, vocab] logits to
    fp32 (4 B x tokens x vocabulary / TP per micro-batch) and passes over the copy several times.
    Replaces the model's `compute_language_model_loss` (so it also wins over `cross_entropy_loss_fusion`).
    Measured: docs/benchmarks.md, "levers, fourth set". Off by default: the first step compiles (seconds),
    more than a tiny model's run gains."""


@dataclass(kw_only=True)
class Communication:
    """How the collectives run: their timeout, and NCCL options (GPU)."""

    collective_timeout_s: int = 600
    """Seconds a collective waits for its peers before it fails, on every process group (the world's and megatron's;
    torch's own default is 600 s for the world, megatron's 30 min for its groups). A notebook names a stuck
    collective long before this (`cluster.start(stall_s=)`); this bounds how long one can hold the world.
    `cluster.start(collective_timeout_s=)` sets it for the engines."""

    fsdp_all_gather_group: bool = False
    """Megatron-FSDP's parameter all-gathers on an NCCL communicator of their own (megatron's
    `create_all_gather_group`): one communicator runs its collectives in issue order, so a shared one
    makes the next layer's gather wait behind queued gradient reduce-scatters. Costs one communicator."""
    high_priority_comm: bool = False
    """Data-parallel collectives on high-priority CUDA streams (megatron's `high_priority_stream_groups`
    = ["dp_cp"]): their kernels are scheduled ahead of queued compute kernels. GPU (NCCL) only."""
    nccl_max_ctas: int | None = None
    """Most thread blocks (CTAs, one SM each) a data-parallel NCCL collective may run on (megatron's per-communicator
    `max_ctas`, groups dp_cp and dp; NCCL's Hopper default is 32 of 132 SMs). Collectives that overlap compute take
    their SMs from the GEMMs beside them; fewer CTAs leave the GEMMs more, and make each collective slower.
    None: NCCL's choice. GPU (NCCL) only."""


@dataclass(kw_only=True)
class Offload:
    """What lives in host memory between optimizer steps."""

    optimizer_offload: bool = False
    """Keep Adam's exp_avg/exp_avg_sq and the fp32 main weights in (pinned) host memory between
    steps, streamed to the device only for `optimizer.step()` (the kit's `offload.stream_optimizer`,
    applied by `offload.apply_config`; megatron-core 0.16.1's optimizer_cpu_offload fails with
    Megatron-FSDP on DTensor shards). Saves 12 B/param / N on the device, costs 24 B/param / N of
    host<->device copies per step. For all state between steps use `offload.offload`/`reload`."""


MEGATRON_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The dense linears of a megatron GPT layer LoRA can adapt."""
HF_TO_MEGATRON = dict(q_proj="linear_qkv", k_proj="linear_qkv", v_proj="linear_qkv", o_proj="linear_proj",
                      gate_proj="linear_fc1", up_proj="linear_fc1", down_proj="linear_fc2")
"""HF (Llama/Qwen) module names -> the megatron linear holding them."""


@dataclass(kw_only=True)
class LoRAConfig:
    """Low-rank adapters: W x + (alpha / rank) * B A x, with only A and B trained."""

    rank: int = 8
    """Inner dimension r of A (r x in) and B (out x r); the bridge's `dim`."""
    alpha: int = 16
    """Scale numerator: the adapter's output is multiplied by alpha / rank (the bridge takes an int)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (the bridge's dropout_position "pre"), in [0, 1)."""
    target_modules: list = field(default_factory=lambda: list(MEGATRON_TARGETS))
    """Linears to adapt: megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2) or HF names
    (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; fused ones as whole groups)."""

    def __post_init__(self):
        self.validate()

    def validate(self) -> "LoRAConfig":
        """Raise `ConfigError` naming the bad field, its value and what is allowed."""
        check_field_types(self)
        if self.rank < 1:
            raise bad_value("lora.rank", self.rank, "an integer >= 1")
        if self.alpha < 1:
            raise bad_value("lora.alpha", self.alpha, "an integer >= 1")
        if not (finite(self.dropout) and 0 <= self.dropout < 1):
            raise bad_value("lora.dropout", self.dropout, "a number in [0, 1)")
        names = MEGATRON_TARGETS + tuple(HF_TO_MEGATRON)
        for name in self.target_modules:
            if name not in names:
                raise bad_value("lora.target_modules", self.target_modules, f"a non-empty list of {' | '.join(names)}")
        if not self.target_modules:
            raise bad_value("lora.target_modules", self.target_modules, f"a non-empty list of {' | '.join(names)}")
        for fused in MEGATRON_TARGETS:
            group = sorted(hf for hf, m in HF_TO_MEGATRON.items() if m == fused)
            given = sorted(set(group) & set(self.target_modules))
            if given and given != group:
                raise bad_value("lora.target_modules", self.target_modules,
                                f"all of {group} or none: megatron fuses them into {fused}, one adapter for all")
        return self

    def megatron_targets(self) -> list[str]:
        """The megatron linear names the targets map to, each once, in megatron's layer order."""
        wanted = {HF_TO_MEGATRON.get(name, name) for name in self.target_modules}
        return [name for name in MEGATRON_TARGETS if name in wanted]


def check_lora(*, lora) -> None:
    """`EngineConfig.lora`: None or a valid `LoRAConfig`."""
    if lora is not None and not isinstance(lora, LoRAConfig):
        raise bad_value("lora", lora, "None | LoRAConfig(rank=..., alpha=..., dropout=..., target_modules=[...])")
    if lora is not None:
        lora.validate()


SECTIONS: dict[str, type] = {"parallelism": Parallelism, "wrapper": Wrapper, "kernels": Kernels,
                             "communication": Communication, "offload": Offload}
"""EngineConfig field -> its section class, in the order they are declared there."""
