"""Greedy decoding with stop ids on the Megatron-FSDP model against transformers (run by launch.run)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.train import generate
from mfsdp_kit.config import EngineConfig
from mfsdp_kit.models.hf import load
from mfsdp_kit.models.tiny import tiny


def hf_greedy(src: str, prompts: list[list[int]], *, max_new_tokens: int, stop_ids: list[int] | None) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    out = []
    for p in prompts:   # one at a time: no padding, so stop ids are the only thing ending a row
        gen = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=stop_ids, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def greedy_stops(*, workdir: str, max_new_tokens: int = 12) -> dict:
    """Prompts of three lengths; the stop ids are two tokens the model emits early on its own (a
    random model rarely emits eos). Megatron-FSDP greedy == HF greedy with the same stop list,
    and decoding ends early (fewer forwards) once every row on both ranks has stopped."""
    cfg = EngineConfig(use_megatron_fsdp=True, seed=0)
    rt = runtime.init(cfg)
    src = f"{workdir}/tiny_xs"
    if rt.rank == 0:
        tiny(src, size="xs", seed=0)
    dist.barrier()
    prompts = [[4, 7, 16, 7, 19, 5], [4, 8, 16, 9, 19, 5], [4, 9, 9, 16, 7, 19, 5], [4, 12, 19, 5], [4, 10, 16, 11, 19, 5]]
    free = hf_greedy(src, prompts, max_new_tokens=max_new_tokens, stop_ids=[10**6])   # an id never sampled
    stop_ids = sorted({free[0][2], free[3][1]})
    hf = hf_greedy(src, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    model = load(src, cfg)
    calls = []
    forward = generate.logits
    generate.logits = lambda *a, **k: calls.append(1) or forward(*a, **k)
    try:
        mine = generate.greedy(model.chunks, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids, vocab_size=128)
        forwards = len(calls)
        unstopped = generate.greedy(model.chunks, prompts, max_new_tokens=max_new_tokens, stop_ids=[10**6])
    finally:
        generate.logits = forward
    parts = [None] * rt.world_size
    dist.all_gather_object(parts, mine)
    merged = {int(i): row for part in parts for i, row in part.items()}
    engine.settle_param_gathers(model.chunks)
    runtime.shutdown()
    return dict(megatron=[merged[i] for i in range(len(prompts))], hf=[generate.cut_at_stop(r, stop_ids) for r in hf],
                free=free, stop_ids=stop_ids, forwards=forwards,
                forwards_unstopped=len(calls) - forwards, unstopped=sorted(map(len, unstopped.values())))
