"""LoRA adapters out of the training chunks, in the files HF `peft` writes and reads.

`peft.PeftModel.from_pretrained(base, folder)` reads two files: `adapter_config.json` (r, lora_alpha,
target_modules by HF module name...) and `adapter_model.safetensors`, whose keys are
`base_model.model.<HF module>.lora_A.weight` (r x in) and `...lora_B.weight` (out x r). Megatron's adapters sit
on its fused linears, so the names and the splits are the bridge's own export mapping, the one `sync` uses for
the base weights (`MegatronPeftBridge.stream_adapter_weights_megatron_to_hf`): `linear_qkv`'s B is split into
q/k/v_proj by the query-group layout, `linear_fc1`'s into gate/up_proj halves, and the one A a fused linear shares
is written for each of its HF modules (peft computes q = W_q x + s B_q A x with the same A: the same numbers).
Under Megatron-FSDP the adapters are all-gathered first (`adapters_gathered`, which `weights.sync` uses too).

The folder appears whole or not at all (`folders.written_aside`: written into a hidden sibling, then renamed into
place); an earlier adapter folder at the path is replaced, any other non-empty folder refused.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from .. import folders, lora
from ..compat.access import fsdp as megatron_fsdp
from ..distributed import runtime
from ..distributed.engine import params_view, unwrap_model
from ..distributed.introspect import is_fsdp

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What peft puts before the HF module name in an adapter file's keys (PeftModel -> LoraModel -> the HF model)."""


@contextlib.contextmanager
def adapters_gathered(chunks) -> Iterator[None]:
    """Inside the block, every FSDP chunk's LoRA adapters show their full values in the compute view (one
    all-gather of their buckets, released at the end). No-op for DDP and for models without adapters.
    The bridge reads them while converting the base weight they belong to: the export here, and `weights.sync`'s
    merged exports (`sync.adapters_gathered` is this)."""
    gathered = []
    try:
        for inner in unwrap_model([c for c in chunks if is_fsdp(c)]):
            params = [p for name, p in inner.named_parameters() if lora.is_adapter(name)]
            fsdp = megatron_fsdp.owner(chunks, params[0]) if params else None
            if fsdp is None:
                continue
            fsdp.all_gather_and_wait_parameters_ready(params=params, prefetch=False)
            gathered += [(fsdp, unit) for unit in {megatron_fsdp.unit_of(fsdp, p) for p in params}]
        yield
    finally:
        for fsdp, unit in gathered:
            megatron_fsdp.release_unit(fsdp, unit)


def export_adapter_weights(chunks, bridge, *, cpu: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF LoRA name, full tensor), e.g. `model.layers.0.self_attn.q_proj.lora_B.weight`, from DDP or
    Megatron-FSDP chunks at any TP. Collective: every rank iterates the whole stream."""
    inner = unwrap_model(list(chunks))
    with params_view(chunks, "compute"), adapters_gathered(chunks):
        for name, tensor in bridge.export_adapter_weights(inner, cpu=cpu, show_progress=False):
            yield name, tensor.detach().clone()   # a view of a gathered bucket is released after the block


def adapter_shape(chunks) -> dict:
    """{"rank": r, "alpha": alpha, "dropout": p} of the chunks' adapters (all share them: `lora.apply`)."""
    for chunk in unwrap_model(list(chunks)):
        for module in chunk.modules():
            if all(hasattr(module, a) for a in ("linear_in", "linear_out", "dim", "alpha")):   # ParallelLinearAdapter
                dropout = getattr(module, "dropout", None)
                return dict(rank=module.dim, alpha=module.alpha, dropout=float(getattr(dropout, "p", 0.0)))
    raise ValueError("these chunks hold no LoRA adapter: load the model with EngineConfig(lora=LoRAConfig(...))")


def peft_config(*, rank: int, alpha: int, dropout: float, target_modules: list[str], base_path) -> dict:
    """The `adapter_config.json` peft's `LoraConfig` reads: the scale alpha / rank on every target."""
    return dict(peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=alpha, lora_dropout=dropout,
                target_modules=sorted(target_modules), base_model_name_or_path=str(base_path), bias="none",
                fan_in_fan_out=False, inference_mode=True, use_rslora=False, use_dora=False, modules_to_save=None,
                init_lora_weights=True)


def save_adapter(*, chunks, bridge, path, base_path=None) -> Path:
    """Write the adapters as a peft folder at `path` (`PeftModel.from_pretrained(base, path)` loads it).

    Collective: every rank streams the weights, rank 0 writes. `base_path` (default: the folder the model was
    loaded from, `lora.base_of`) goes into the config as `base_model_name_or_path`. Returns `path`."""
    from safetensors.torch import save_file
    base_path = base_path or (lora.base_of(chunks) or {}).get("path")
    shape = adapter_shape(chunks)
    path = Path(path)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    verdict = runtime.broadcast(refusal(path) if rank0 else None)   # rank 0's, on every rank, before the export
    if verdict:
        raise FileExistsError(verdict)
    weights = {f"{PEFT_PREFIX}{name}": t.contiguous() for name, t in export_adapter_weights(chunks, bridge)}
    if rank0:
        targets = {name.split(".")[-3] for name in weights}   # ...<module>.lora_A.weight
        config = peft_config(**shape, target_modules=sorted(targets), base_path=base_path)
        with folders.written_aside(path, replace=True, mode=0o755) as tmp:   # a folder as `mkdir` makes it
            save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    runtime.barrier()
    return path


def refusal(path: Path) -> str | None:
    """Why `save_adapter` may not write `path` (a non-empty folder that is not an earlier adapter), or None."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())) and not (path / CONFIG_FILE).is_file():
        return (f"{path} exists and is not an adapter folder (no {CONFIG_FILE}): save_adapter replaces only an "
                "earlier adapter; pass an empty or new folder")
    return None
