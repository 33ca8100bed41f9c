"""What each rank holds, in bytes, next to the ZeRO formula for the same model.

Adam with mixed precision keeps per parameter (the ZeRO paper's accounting):
    bf16/fp16 compute: weights 2 B + grads 2 B + optimizer K = 12 B (fp32 main weights 4 + two moments 8)
    fp32 compute:      weights 4 B + grads 4 B + optimizer K =  8 B (two moments; the weights are the main copy)
    = 16 bytes/param either way. Sharding over N data-parallel ranks:
    DDP + distributed optimizer (ZeRO-1):       weights + grads + K/N   (bf16: 4 + 12/N)
    Megatron-FSDP optim_grads_params (ZeRO-3):  16/N
LoRA (`lora_formula_bytes`): the frozen base keeps its weights only (bf16 2 B, fp32 4 B; / N under FSDP, whole
under DDP); the adapters, a fraction f of it (~0.5 % at rank 16 on a 7 B model), take the 16 B above. A 7 B model
in bf16 on 1 GPU: full 16 x 7e9 = 112 GB; LoRA 2 x 7e9 + 16 x 4e7 = 14.6 GB.
Megatron keeps grads in fp32 buffers by default in FSDP, so measured grads can exceed the
paper's 2 B; the report measures the buffers themselves (distinct storages), not the formula.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .engine import unwrap_model
from .introspect import fsdp_buffers, inner_optimizers, is_fsdp, local, main_params


@dataclass
class MemoryReport:
    """Bytes this rank holds, by kind."""

    params_bytes: int
    grads_bytes: int
    main_params_bytes: int
    optimizer_states_bytes: int
    activations_peak_bytes: int
    """Peak allocated minus model state (0 on CPU, where no allocator statistics exist)."""
    num_params: int
    """Parameters of the whole model (global, unsharded)."""
    dp_size: int
    """Data-parallel ranks the sharded state is spread over: all of them, or one HSDP instance's (hsdp.py)."""

    @property
    def model_state_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.main_params_bytes + self.optimizer_states_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "model_state_bytes": self.model_state_bytes}


def _nbytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = local(t)
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _optimizer_state_tensors(optimizer):
    for opt in inner_optimizers(optimizer):
        for state in opt.optimizer.state.values():
            yield from (v for v in state.values() if torch.is_tensor(v) and v.numel() > 1)


def memory_report(chunks, optimizer) -> MemoryReport:
    """Per-rank bytes of params, grads, main params and optimizer states (after >= 1 step)."""
    from megatron.core import parallel_state as ps
    if all(is_fsdp(c) for c in chunks):
        params = _nbytes(fsdp_buffers(chunks, "model_weight_buffer"))
        grads = _nbytes(fsdp_buffers(chunks, "main_grad_buffer"))
        main = _nbytes(fsdp_buffers(chunks, "main_weight_buffer"))
    else:
        # DDP keeps MoE experts' params and grads in separate expert-parallel buffers
        buffers = [b for c in chunks for b in (*c.buffers, *getattr(c, "expert_parallel_buffers", ()))]
        params = _nbytes(b.param_data for b in buffers)
        grads = _nbytes(b.grad_data for b in buffers)
        main = _nbytes(main_params(optimizer))
    states = _nbytes(_optimizer_state_tensors(optimizer))
    instances = chunks[0].ddp_config.num_distributed_optimizer_instances   # HSDP: state sharded within one
    num_params = sum(p.numel() for c in unwrap_model(chunks) for p in c.parameters())
    model_state = params + grads + main + states
    peak = torch.cuda.max_memory_allocated() - model_state if torch.cuda.is_available() else 0
    return MemoryReport(params_bytes=params, grads_bytes=grads, main_params_bytes=main,
                        optimizer_states_bytes=states, activations_peak_bytes=max(peak, 0),
                        num_params=num_params, dp_size=ps.get_data_parallel_world_size() // instances)


def zero_formula_bytes(*, num_params: int, dp_size: int, fsdp: bool, dtype: str) -> int:
    """Model-state bytes per rank the ZeRO formula predicts (see the module docstring)."""
    weights = grads = 4 if dtype == "fp32" else 2
    optimizer = 8 if dtype == "fp32" else 12
    if fsdp:
        return (weights + grads + optimizer) * num_params // dp_size
    return (weights + grads) * num_params + optimizer * num_params // dp_size


def lora_formula_bytes(*, num_base_params: int, num_adapter_params: int, dp_size: int, fsdp: bool, dtype: str) -> int:
    """Model-state bytes per rank of a LoRA model: the frozen base's weights, plus the ZeRO formula of the adapters."""
    weights = 4 if dtype == "fp32" else 2
    base = weights * num_base_params // (dp_size if fsdp else 1)
    return base + zero_formula_bytes(num_params=num_adapter_params, dp_size=dp_size, fsdp=fsdp, dtype=dtype)


def format_table(reports: dict[str, MemoryReport], *, dtype: str) -> str:
    """A text table: one column per run (e.g. "DDP", "FSDP"), MiB per kind, and the formula."""
    rows = ["params_bytes", "grads_bytes", "main_params_bytes", "optimizer_states_bytes", "model_state_bytes",
            "activations_peak_bytes"]
    names = list(reports)
    lines = [f"{'MiB per rank':<26}" + "".join(f"{n:>14}" for n in names)]
    for row in rows:
        lines.append(f"{row:<26}" + "".join(f"{reports[n].as_dict()[row] / 2**20:>14.2f}" for n in names))
    formula = [zero_formula_bytes(num_params=r.num_params, dp_size=r.dp_size, fsdp="FSDP" in n.upper(),
                                  dtype=dtype) for n, r in reports.items()]
    lines.append(f"{'ZeRO formula model state':<26}" + "".join(f"{f / 2**20:>14.2f}" for f in formula))
    return "\n".join(lines)
