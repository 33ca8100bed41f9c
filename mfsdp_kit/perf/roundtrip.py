"""HF -> Megatron (DDP | Megatron-FSDP) -> HF, checked and timed: the proof that a Hugging Face
model survives the kit and comes back out unchanged.

Each number says which link of the chain would be broken if it were off:
- logits_maxdiff: Megatron's logits vs transformers' on the same folder (load: the conversion);
- export_maxdiff / export_names_match: export before any step == the HF state dict (export: the
  gather of FSDP shards and the inverse conversion), and its GB/s;
- changed_by_step: one optimizer step changes every exported tensor (export reads live weights);
- reload_vs_megatron_maxdiff: save_hf, reload with transformers, logits == Megatron's live ones.
bench/roundtrip.py prints these for DDP and FSDP side by side; tests/models/test_hf.py asserts them.
"""
from __future__ import annotations

import os
import time

import torch

from ..distributed import engine, runtime
from ..weights import sync
from ..config import EngineConfig, OptimConfig, Parallelism, Wrapper
from ..train.data import random_token_batches
from ..train.generate import logits
from ..distributed.introspect import torch_dtype
from ..models.hf import load
from ..models.tiny import tiny
from ..train import step


def roundtrip(*, arch: str, size: str, tp: int, fsdp: bool, dtype: str, workdir: str) -> dict:
    """Run the chain once on a tiny `arch` model of `size` (models.tiny) under the current torchrun
    world; rank 0's dict holds every number (and `exported_file`, the weights after one step)."""
    import transformers
    from safetensors.torch import save_file
    cfg = EngineConfig(wrapper=Wrapper(use_megatron_fsdp=fsdp), parallelism=Parallelism(tensor_model_parallel_size=tp),
                       dtype=dtype, seed=3)
    rt = runtime.init(cfg)
    src = f"{workdir}/src_{arch}_{size}"
    if rt.rank == 0 and not os.path.exists(f"{src}/config.json"):
        tiny(src, arch=arch, size=size, seed=1)
    runtime.barrier()
    model = load(src, cfg)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype(dtype)).to(rt.device).eval()
    vocab = hf.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(5)).to(rt.device)
    with torch.no_grad():
        ref_logits = hf(tokens).logits.float()
    result = dict(wrapper=type(model.chunks[0]).__name__,
                  logits_maxdiff=(logits(model.chunks, tokens, vocab_size=vocab) - ref_logits).abs().max().item())
    original = {k: v.cpu() for k, v in hf.state_dict().items()}
    t0 = time.perf_counter()
    exported = dict(sync.export_hf_weights(model.chunks, model.bridge))
    seconds = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in exported.values())
    result.update(export_s=seconds, export_bytes=nbytes, export_gbps=nbytes / seconds / 1e9,
                  export_names_match=sorted(exported) == sorted(original),
                  export_maxdiff=max((exported[k].float() - original[k].float()).abs().max().item() for k in original))
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-2 if dtype == "fp32" else 1e-4), cfg)
    step(model.chunks, opt, random_token_batches(steps=1, global_batch=4, seq_len_tokens=16, vocab_size=vocab,
                                                 seed=9)[0], micro_batch_size=2)
    trained = dict(sync.export_hf_weights(model.chunks, model.bridge))
    result["changed_by_step"] = sum(not torch.equal(trained[k], original[k]) for k in original)
    out = f"{workdir}/saved_{arch}_{size}_tp{tp}_{'fsdp' if fsdp else 'ddp'}"
    sync.save_hf(model.chunks, model.bridge, out)
    live = logits(model.chunks, tokens, vocab_size=vocab)
    if rt.rank == 0:
        save_file(trained, f"{out}.exported.safetensors")
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch_dtype(dtype)).to(rt.device).eval()
        with torch.no_grad():
            result["reload_vs_megatron_maxdiff"] = (reloaded(tokens).logits.float() - live).abs().max().item()
        result["exported_file"] = f"{out}.exported.safetensors"
    del model, opt, hf
    runtime.shutdown()
    return result
