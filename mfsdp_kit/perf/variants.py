"""The named training configurations a benchmark compares, each one knob away from its baseline.

Three trainers train the SAME megatron GPT (local spec, same attention backend, seed, batches):
- ddp:   megatron DistributedDataParallel + distributed optimizer (ZeRO-1), bf16 Float16Module;
- fsdp:  Megatron-FSDP, optim_grads_params (ZeRO-3);
- fsdp2: torch `fully_shard` per TransformerLayer then the root (perf.trainers.build_fsdp2).
A variant is (trainer, EngineConfig overrides): fsdp-recompute is fsdp with recompute="full", so
each knob is measured in the same run as the mode it changes. An "optim" entry of the overrides
holds OptimConfig fields instead (fsdp-foreach-adam); a "finalize" entry picks megatron's finalize_model_grads
over the kit's (fsdp-megatron-finalize); an "fsdp2" entry holds build_fsdp2's options (fsdp2-keep-gathered).
"""
from __future__ import annotations

import argparse
import json

import torch

from ..config import EngineConfig
from ..config.flat import nest
from ..lora import LoRAConfig
from ..models.gpt import GPTSpec
from ..train.options import StepOptions
from . import options
from .flops import layer_params

TRAINERS = ("ddp", "fsdp", "fsdp2")


def megatron_default_unit_elements(spec: GPTSpec) -> int:
    """What Megatron-FSDP uses when `suggested_communication_unit_size` is None (megatron-core
    0.16.1, megatron_fsdp.py, MegatronFSDP.__init__): twice the mean elements of an FSDP unit
    (a TransformerLayer), then `max(1e9, ...)` - commented "Cap to 1B elements" but a floor
    (upstream fixes it to `min`: NVIDIA/Megatron-LM PR #7134), so it is 1e9 elements for every
    spec of gpt.SPECS (a 7b layer is 0.2e9). Megatron then prefetches all-gathers up to unit // 2
    elements ahead of the running layer (5e8 = 1 GB of bf16 weights, ~10 layers of 1.7b) and
    lets up to unit elements of gradient reduce-scatters queue before it waits."""
    return max(1_000_000_000, 2 * layer_params(spec))


# name -> (trainer, EngineConfig overrides, or a function of the spec returning them).
# override_ddp_config entries are merged into the command line's overrides, not replacing them.
VARIANTS = {
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {}),
    "fsdp2": ("fsdp2", {}),
    # How much does overlap buy? The two flags alone change nothing: MegatronFSDP.__init__ sets
    # both back to True for optim_grads_params (megatron_fsdp.py:274-279, megatron-core 0.16.1).
    # What does stop the overlap is a unit of 1 element: no all-gather prefetch (each layer's
    # all-gather starts when the layer needs it) and a reduce-scatter queue of 1 element (each
    # reduce-scatter waits for the previous one before backward goes on).
    "fsdp-no-overlap": ("fsdp", dict(override_ddp_config=dict(
        overlap_param_gather=False, overlap_grad_reduce=False, suggested_communication_unit_size=1))),
    # twice the prefetch depth and reduce-scatter queue: more memory, fewer waits?
    "fsdp-unit2x": ("fsdp", lambda spec: dict(override_ddp_config=dict(
        suggested_communication_unit_size=2 * megatron_default_unit_elements(spec)))),
    # megatron's own unit (1e9 elements here): the kit's default is 2 x the mean layer, i.e.
    # prefetch about one layer ahead (compat.access.fsdp_unit)
    "fsdp-unit-1e9": ("fsdp", lambda spec: dict(override_ddp_config=dict(
        suggested_communication_unit_size=megatron_default_unit_elements(spec)))),
    # "full", not "selective": selective recomputes core attention only, and SDPA already keeps
    # no S x S scores, so it would cost time and save nothing. Full recomputes each layer's
    # forward in backward (+1 forward, ~+33 % FLOPs) and keeps only layer inputs.
    "fsdp-recompute": ("fsdp", dict(recompute="full")),
    "ddp-recompute": ("ddp", dict(recompute="full")),
    "fsdp2-recompute": ("fsdp2", dict(recompute="full")),
    # Adam moments + fp32 main weights (12 B/param / N) on the host between steps (mfsdp_kit.distributed.offload)
    "fsdp-optoffload": ("fsdp", dict(optimizer_offload=True)),
    # the effect of fused kernels in the same run (megatron's unfused RoPE and SwiGLU)
    "fsdp-unfused": ("fsdp", dict(fused_kernels=False)),
    # ---- the levers of issue 22, each one knob away from fsdp (or ddp) ----
    # torch's foreach Adam ops (what megatron leaves torch to pick) instead of the kit's fused default
    "fsdp-foreach-adam": ("fsdp", dict(optim=dict(adam_implementation="foreach"))),
    "ddp-foreach-adam": ("ddp", dict(optim=dict(adam_implementation="foreach"))),
    # two fixed, persistent all-gather / reduce-scatter buffers reused unit after unit
    # (FixedPoolAllocator) instead of resizing per-unit storage on every gather
    "fsdp-double-buffer": ("fsdp", dict(override_ddp_config=dict(fsdp_double_buffer=True))),
    # NCCL user-buffer registration of those buffers (implies the double buffer; needs
    # megatron.core.nccl_allocator, i.e. NCCL's ncclMemAlloc / window registration)
    "fsdp-nccl-ub": ("fsdp", dict(override_ddp_config=dict(nccl_ub=True))),
    # all-gathers on their own NCCL communicator: no waiting behind queued reduce-scatters
    "fsdp-ag-group": ("fsdp", dict(fsdp_all_gather_group=True)),
    # data-parallel NCCL kernels on high-priority streams (GPU only), alone and with the AG communicator
    "fsdp-high-prio": ("fsdp", dict(high_priority_comm=True)),
    "fsdp-ag-group-hp": ("fsdp", dict(fsdp_all_gather_group=True, high_priority_comm=True)),
    # data-parallel NCCL collectives capped at 8 / 16 CTAs (NCCL's Hopper default: 32 SMs): SMs back to the GEMMs
    # the gathers and reduce-scatters overlap (GPU only)
    "fsdp-ctas8": ("fsdp", dict(nccl_max_ctas=8)),
    "fsdp-ctas16": ("fsdp", dict(nccl_max_ctas=16)),
    "ddp-ctas8": ("ddp", dict(nccl_max_ctas=8)),
    # megatron's native fused cross-entropy (jit_fuser = torch.compile) instead of its unfused
    # vocab-parallel one: fewer passes over the [tokens, vocab] logits
    "fsdp-ce-fusion": ("fsdp", dict(override_transformer_config=dict(cross_entropy_loss_fusion=True))),
    # the kit's cross-entropy (models.cross_entropy): the bf16 logits read in compiled kernels, no fp32 copy
    "ddp-fused-ce": ("ddp", dict(fused_cross_entropy=True)),
    "fsdp-fused-ce": ("fsdp", dict(fused_cross_entropy=True)),
    "fsdp2-fused-ce": ("fsdp2", dict(fused_cross_entropy=True)),
    # megatron's own finalize_model_grads (its `num_tokens > 0` host sync after backward) instead of the kit's
    # engine.finalize_grads, which scales by the token count on the device
    "ddp-megatron-finalize": ("ddp", dict(finalize="megatron")),
    "fsdp-megatron-finalize": ("fsdp", dict(finalize="megatron")),
    # megatron's own fp32 grad copies (the whole shard when backward ends, held through the step) instead of the
    # kit's default, grad_upcast's copies a part at a time inside the step
    "fsdp-upcast-whole": ("fsdp", dict(optim=dict(grad_upcast="whole"))),
    # reduce-scatter gradients in fp32 (FSDP2's default here) instead of bf16
    "fsdp-grad-fp32": ("fsdp", dict(override_ddp_config=dict(grad_reduce_in_fp32=True))),
    # each unit gathered once a step, kept through every micro-batch's forward and backward (keep_gathered), instead
    # of megatron's gather per forward and per backward of each micro-batch: +the whole bf16 model during the step
    "fsdp-keep-gathered": ("fsdp", dict(fsdp_keep_gathered=True)),
    # FSDP2's same trade, for a like-for-like comparison: reshard_after_forward=False, and no reshard after the
    # backward of any but the step's last micro-batch (an "fsdp2" entry holds build_fsdp2's options)
    "fsdp2-keep-gathered": ("fsdp2", dict(fsdp2=dict(keep_gathered=True))),
    # LoRA rank 16 (alpha 32) on every linear of every layer (EngineConfig.lora): the base frozen (bf16 weights
    # only, sharded under fsdp), grads, fp32 main weights and Adam state for the adapters only (bench/lora.py)
    "fsdp-lora16": ("fsdp", dict(lora=LoRAConfig(rank=16, alpha=32))),
    "ddp-lora16": ("ddp", dict(lora=LoRAConfig(rank=16, alpha=32))),
}


def trainer_of(mode: str) -> str:
    """"ddp" | "fsdp" | "fsdp2": which trainer the variant `mode` runs."""
    return VARIANTS[mode][0]


def variant_overrides(mode: str, spec: GPTSpec) -> dict:
    """What variant `mode` sets at `spec` (a fresh dict): EngineConfig fields, plus "optim"."""
    overrides = VARIANTS[mode][1]
    return dict(overrides(spec) if callable(overrides) else overrides)


def optim_overrides(mode: str, spec: GPTSpec) -> dict:
    """The OptimConfig fields variant `mode` sets (empty for most)."""
    return dict(variant_overrides(mode, spec).get("optim", {}))


def fsdp2_options(mode: str, spec: GPTSpec) -> dict:
    """The `build_fsdp2` options variant `mode` sets (empty for most)."""
    return dict(variant_overrides(mode, spec).get("fsdp2", {}))


def uses_megatron_finalize(mode: str, spec: GPTSpec) -> bool:
    """Whether variant `mode` finalizes grads with megatron's finalize_model_grads instead of the kit's."""
    return variant_overrides(mode, spec).get("finalize") == "megatron"


def engine_config(mode: str, spec: GPTSpec, *, dtype: str, attention: str, recompute: str = "none",
                  fused_kernels: bool = False, fused_cross_entropy: bool = False,
                  fsdp_overrides: dict | None = None, ddp_overrides: dict | None = None) -> EngineConfig:
    """The EngineConfig of variant `mode`: the shared settings, then the variant's overrides.
    `fsdp_overrides` / `ddp_overrides` are the override_ddp_config of the fsdp / ddp trainers."""
    trainer = trainer_of(mode)
    overrides = variant_overrides(mode, spec)
    overrides.pop("optim", None)
    overrides.pop("finalize", None)
    overrides.pop("fsdp2", None)
    ddp_config = dict((fsdp_overrides if trainer == "fsdp" else ddp_overrides) or {})
    ddp_config.update(overrides.pop("override_ddp_config", {}))
    fields = dict(
        use_megatron_fsdp=trainer == "fsdp", dtype=dtype, attention_backend=attention,
        recompute=recompute, fused_kernels=fused_kernels, fused_cross_entropy=fused_cross_entropy, seed=1234,
        override_ddp_config=ddp_config,
        # Initialise on the GPU: CPU init of billions of parameters takes minutes.
        override_transformer_config=dict(use_cpu_initialization=False) if torch.cuda.is_available() else {})
    fields["override_transformer_config"].update(overrides.pop("override_transformer_config", {}))
    return EngineConfig(**nest({**fields, **overrides}))   # VARIANTS rows name fields by their flat names


# ---- the command line of the benchmarks that compare variants (bench/throughput.py, max_model.py) ----
def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """The options `engine_config_from_args` reads."""
    on_gpu = torch.cuda.is_available()
    ap.add_argument("--attention", default="sdpa", choices=["local", "sdpa"])
    ap.add_argument("--dtype", default="bf16" if on_gpu else "fp32", choices=["bf16", "fp32"])
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    ap.add_argument("--fused-kernels", action="store_true",
                    help="EngineConfig.kernels.fused_kernels: compiled RoPE + SwiGLU")
    ap.add_argument("--fused-cross-entropy", action="store_true",
                    help="EngineConfig.kernels.fused_cross_entropy: the loss from the bf16 logits in compiled kernels")
    ap.add_argument("--fsdp-overrides", default='{"overlap_param_gather": true}',
                    help="JSON for EngineConfig.wrapper.override_ddp_config in the fsdp modes")
    ap.add_argument("--ddp-overrides", default='{"overlap_grad_reduce": true}',
                    help="JSON for EngineConfig.wrapper.override_ddp_config in the ddp mode")
    ap.add_argument("--timeout-s", type=float, default=600.0)


def add_step_args(ap: argparse.ArgumentParser) -> None:
    """Batch and step options of the throughput benches: `train.StepOptions`' fields (`perf.options`:
    `options.build(StepOptions, args, prefix="")` reads them back), sequences per step, steps."""
    on_gpu = torch.cuda.is_available()
    options.add_options(ap, StepOptions, prefix="", defaults=dict(micro_batch_size=4 if on_gpu else 2))
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: mbs * world)")
    ap.add_argument("--steps", type=int, default=8, help="measured steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)


def engine_config_from_args(args: argparse.Namespace, mode: str, spec: GPTSpec) -> EngineConfig:
    """`engine_config` with the settings of `add_engine_args`' options."""
    return engine_config(mode, spec, dtype=args.dtype, attention=args.attention, recompute=args.recompute,
                         fused_kernels=args.fused_kernels, fused_cross_entropy=args.fused_cross_entropy,
                         fsdp_overrides=json.loads(args.fsdp_overrides),
                         ddp_overrides=json.loads(args.ddp_overrides))


def parse_modes(ap: argparse.ArgumentParser, text: str) -> list[str]:
    """"ddp,fsdp" -> ["ddp", "fsdp"]; an unknown name ends the program with argparse's error."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        if m not in VARIANTS:
            ap.error(f"mode {m!r} is not one of {', '.join(VARIANTS)}")
    return modes
