"""The seconds a pass cannot beat on a given GPU: its model FLOPs at the GEMM rate the GPU reaches, or its bytes at
the memory bandwidth, whichever is larger. An RL iteration's parts (weight sync, rollout, old log-probs, update)
are drawn beside these floors (`plots.iteration_time(floors=)`), so the distance left is visible.

    hw = floors.hardware()                  # None on a CPU or on a GPU whose rates are not listed here
    rows = floors.rl_iterations(history, params=n, hw=hw, world=1)   # [{part: seconds}] per iteration
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .flops import PEAK_FLOPS_PER_GPU


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    matmul_flops: float
    """Dense bf16 FLOP/s a large GEMM reaches on this GPU (measured, below the datasheet's peak)."""
    memory_bytes_per_s: float
    """HBM bandwidth, bytes/s (the datasheet's)."""


HARDWARE = {"H200": Hardware(name="H200", matmul_flops=790e12, memory_bytes_per_s=4.8e12),
            "H100 80GB HBM3": Hardware(name="H100 SXM", matmul_flops=772e12, memory_bytes_per_s=3.35e12)}
"""GPUs whose rates the kit has measured (docs/benchmarks.md: torch.matmul at 8192^3 in bf16 ran 790 TFLOP/s on
an H200 and 772 TFLOP/s on an H100 SXM, `bench/decode_gemm.py` in 14fe46d); a device name containing the key
matches (the H100's PCIe card, 2.0 TB/s, does not)."""


def hardware(device: torch.device | str | None = None) -> Hardware | None:
    """This process's GPU's rates (HARDWARE), or None on a CPU or an unlisted GPU: no floor is then claimed."""
    if not torch.cuda.is_available() or torch.device(device or "cuda").type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((hw for key, hw in HARDWARE.items() if key in name), None)


def rl_iteration(*, params: int, train_tokens: float, new_tokens: float, decode_steps: int, sync_bytes: float,
                 hw: Hardware, world: int = 1, logprob_passes: int = 1, lora: bool = False) -> dict[str, float]:
    """Seconds per part of one RL iteration on each of `world` GPUs sharing the work by data parallelism.

    params: parameters in a matmul (embedding table excluded); train_tokens: prompt + response tokens the
    trainer scores; new_tokens: sampled tokens; decode_steps: sequential decode steps (each reads every weight
    once: at least the longest response); sync_bytes: bytes copied into the rollout model (read + write);
    logprob_passes: no-grad forwards over the batch before the update (0 when the update's gives pi_old);
    lora: the base is frozen (LoRA), so the backward computes no weight gradients.
    Forward 2N, forward + backward 6N FLOPs per token (4N with `lora`); attention's few percent left out."""
    flops, bw = hw.matmul_flops * world, hw.memory_bytes_per_s
    return dict(sync_s=2 * sync_bytes / (bw * world),
                rollout_s=max(2 * params * new_tokens / flops, decode_steps * 2 * params / bw),
                logprob_s=logprob_passes * 2 * params * train_tokens / flops,
                update_s=(4 if lora else 6) * params * train_tokens / flops)


def rl_iterations(history, *, params: int, hw: Hardware | None, samples: int, world: int = 1,
                  decode_steps: list[int] | None = None, lora: bool = False) -> list[dict[str, float]] | None:
    """`rl_iteration` for each iteration of a GRPO/DAPO history (`samples` completions an iteration; decode steps:
    the engine's count where known, else the longest response; `lora` as there); None without `hw`."""
    if hw is None:
        return None
    steps = decode_steps or history.response_tokens_max
    passes = getattr(history, "logprob_passes", None) or [1] * len(steps)   # histories from before rl.on_policy: 1
    return [rl_iteration(params=params, train_tokens=(p + r) * samples, new_tokens=r * samples, decode_steps=s,
                         sync_bytes=b, hw=hw, world=world, logprob_passes=n, lora=lora)
            for p, r, s, b, n in zip(history.prompt_tokens, history.response_tokens, steps,
                                     history.sync_bytes or [0] * len(steps), passes)]


def mfu(seconds: float, floor_s: float, hw: Hardware, *, peak_flops: float = PEAK_FLOPS_PER_GPU) -> float:
    """A FLOP-bound pass's model FLOPs utilisation against the datasheet's `peak_flops`, from its floor."""
    return floor_s / max(seconds, 1e-9) * hw.matmul_flops / peak_flops
