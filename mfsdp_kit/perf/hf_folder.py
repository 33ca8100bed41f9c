"""Hugging Face folders of real model shapes, written on the node: what the real-size benchmarks
(bench/load_hf.py, bench/sync.py --shape) load, without downloading a checkpoint.

`write_folder(path, shape, shard_gb=...)` writes the shape's config.json (as transformers writes it
for Qwen2.5-7B or Llama-3-8B), random bf16 weights in safetensors shards of `shard_gb` and a
model.safetensors.index.json. The values are tiled from one seeded normal(0, 0.02) pool, so
writing runs at memory speed, not at the RNG's: a 7.6 B folder is 15 GB and takes a while anyway.

`weights=False` writes the config and the index only (every tensor name, no shard): enough for
Megatron-Bridge to build a provider and its conversion tasks (it orders them by the index's names)
when the weights themselves do not matter, e.g. timing a sync whose result is checked against the
bridge's own export of the same megatron weights. Nothing may read a weight from such a folder.

`write_for_world(name, shape, ...)` is the benchmarks' way to get one folder every rank reads: rank 0 writes it
under a root with room (`pick_root`) and every rank gets its path; `remove_for_world` removes it at the end.
"""
from __future__ import annotations

import json
import shutil
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed import runtime
from ..models import archs

SHAPES = {
    # Qwen/Qwen2.5-7B's config.json: 7.62 B params (q/k/v biases, untied 152064-token embeddings)
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 max_position_embeddings=131072, rope_theta=1e6, rms_norm_eps=1e-6,
                                 tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643)),
    # meta-llama/Meta-Llama-3-8B's config.json: 8.03 B params
    "llama3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                max_position_embeddings=8192, rope_theta=5e5, rms_norm_eps=1e-5,
                                tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)),
    # the CPU smoke shape (tests, gloo)
    "small": ("qwen2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, rope_theta=1e6,
                            rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
}
POOL_ELEMENTS = 1 << 26
"""64 M bf16 values (128 MiB) drawn once; every weight is a tiling of it from a per-tensor offset."""


def pick_root(root: str, need_bytes: int) -> Path:
    """`root` if it has room for the folder (+10 %), else the first of /tmp, runs/ that does."""
    for candidate in (root, "/tmp", "runs"):
        Path(candidate).mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(candidate).free > 1.1 * need_bytes:
            return Path(candidate)
    raise RuntimeError(f"no room for {need_bytes / 2**30:.1f} GiB under {root}, /tmp or runs/")


def write_for_world(name: str, shape: str, *, root: str, shard_gb: float) -> tuple[Path, dict]:
    """(path, `write_folder`'s dict) on every rank: rank 0 writes `shape` as the folder `name` under `root` (or
    where `pick_root` finds room for its bf16 weights), replacing an earlier one. Collective where a process
    group exists."""
    made = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        need_bytes = 2 * sum(s.numel() for s in tensor_shapes(shape).values())   # bf16
        path = pick_root(root, need_bytes) / name
        shutil.rmtree(path, ignore_errors=True)
        made = dict(path=str(path), write=write_folder(path, shape, shard_gb=shard_gb))
    made = runtime.broadcast(made)   # rank 0's, on every rank
    return Path(made["path"]), made["write"]


def remove_for_world(path: Path, *, keep: bool) -> None:
    """After every rank is done with `write_for_world`'s folder, rank 0 removes it unless `keep`. Collective."""
    runtime.barrier()
    if not keep and (not dist.is_initialized() or dist.get_rank() == 0):
        shutil.rmtree(path, ignore_errors=True)


def hf_config(shape: str):
    """The transformers config of `shape` (a key of SHAPES), bf16, with its architecture named."""
    import transformers
    model_type, fields = SHAPES[shape]
    spec = archs.spec_for(model_type)
    config = getattr(transformers, spec.config_class)(**fields, torch_dtype="bfloat16")
    config.architectures = [spec.architecture]
    return config


def tensor_shapes(shape: str) -> dict[str, torch.Size]:
    """HF name -> shape of every tensor of `shape`'s state dict (built on the meta device: no memory)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return {n: p.shape for n, p in AutoModelForCausalLM.from_config(hf_config(shape)).state_dict().items()}


def _weight(name: str, shape: torch.Size, pool: torch.Tensor, *, offset: int) -> torch.Tensor:
    """Norm weights 1; every other tensor the pool tiled from `offset` (bf16)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    t = torch.empty(shape, dtype=torch.bfloat16)
    flat, pos, start = t.view(-1), 0, offset % pool.numel()
    while pos < flat.numel():
        n = min(flat.numel() - pos, pool.numel() - start)
        flat[pos:pos + n] = pool[start:start + n]
        pos, start = pos + n, 0
    return t


def write_folder(path: Path, shape: str, *, shard_gb: float, seed: int = 0, weights: bool = True) -> dict:
    """config.json + bf16 safetensors shards + index (`weights=False`: config + index only); returns
    what was written (seconds, bytes of weights, shards, params)."""
    from safetensors.torch import save_file
    t0 = time.perf_counter()
    path = Path(path)
    shapes = tensor_shapes(shape)
    path.mkdir(parents=True, exist_ok=True)
    hf_config(shape).save_pretrained(path)
    plan, size, limit = [[]], 0, int(shard_gb * 2**30)   # names per shard, by bytes, in the model's order
    for name, shape_ in shapes.items():
        nbytes = 2 * shape_.numel()
        if plan[-1] and size + nbytes > limit:
            plan.append([])
            size = 0
        plan[-1].append(name)
        size += nbytes
    files = [f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))]
    weight_map = {n: file for names, file in zip(plan, files) for n in names}
    total = sum(2 * shapes[n].numel() for n in weight_map)
    if weights:
        pool = torch.empty(POOL_ELEMENTS).normal_(0, 0.02, generator=torch.Generator().manual_seed(seed)).bfloat16()
        for names, file in zip(plan, files):   # one shard in memory at a time
            shard = {name: _weight(name, shapes[name], pool, offset=zlib.crc32(name.encode())) for name in names}
            save_file(shard, str(path / file), metadata={"format": "pt"})
            del shard
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return dict(seconds=time.perf_counter() - t0, bytes=total, shards=len(plan) if weights else 0,
                params=sum(s.numel() for s in shapes.values()))
