"""Architectures written by transformers (models.archs) through the kit, on the torchrun world.

`arch_roundtrip`: load -> wrap (DDP | Megatron-FSDP) -> logits vs HF (models.verify) -> export
exact -> one training step (the loss is finite, the weights move, no padded id reaches the loss)
-> export after the step has the HF shapes. Rank 0's dict holds every number.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.weights import sync
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.train.data import random_token_batches
from mfsdp_kit.models import archs, hf as hf_models
from mfsdp_kit.train.generate import logits
from mfsdp_kit.models.verify import fixed_tokens, hf_logits, verify
from mfsdp_kit.train import forward_backward, step
from scenarios_chat import hf_greedy

GREEDY_TOKENS = 32
TIE = 1e-4   # a top-2 logit gap below this fraction of the logit scale is a tie: roundoff may pick either


@torch.no_grad()
def hf_loss(src: str, batch) -> float:
    """transformers' per-token mean cross-entropy on `batch` (over the real vocabulary only)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    logits = model(batch.tokens).logits.float()
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="none")
    mask = batch.loss_mask.flatten().float()
    return ((losses * mask).sum() / mask.sum()).item()


def greedy_vs_hf(model, src: str, *, vocab_size: int) -> dict:
    """32 greedy tokens from the Megatron model vs transformers' `generate` (no stop id) on two
    prompts. Equal, or equal up to the first position where HF's top-2 logits tie within TIE of
    the logit scale (there fp32 roundoff of either side may pick either token)."""
    from mfsdp_kit.train import generate
    prompts = fixed_tokens(vocab_size, sequences=2, seq_len_tokens=8, seed=11).tolist()
    mine = generate.greedy(model.chunks, prompts, max_new_tokens=GREEDY_TOKENS, stop_ids=[10**6], vocab_size=vocab_size)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    megatron = [{int(i): row for part in parts for i, row in part.items()}[i] for i in range(len(prompts))]
    hf = hf_greedy(src, prompts, max_new_tokens=GREEDY_TOKENS, stop_ids=[10**6])
    out = dict(tokens=GREEDY_TOKENS, equal=megatron == hf, first_diff=None, tie_gap=None)
    for p, a, b in zip(prompts, megatron, hf):
        diff = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is not None and out["first_diff"] is None:
            ref = hf_logits(src, torch.tensor([p + b[:diff]]))[0, -1]
            top2 = ref.topk(2).values
            out.update(first_diff=diff, tie_gap=((top2[0] - top2[1]) / ref.abs().max()).item())
    out["ok"] = out["equal"] or (out["tie_gap"] is not None and out["tie_gap"] < TIE)
    return out


def arch_roundtrip(*, arch: str, tp: int = 1, fsdp: bool = True, workdir: str, vocab_size: int = 256,
                   overrides: dict | None = None, transformer: dict | None = None, train: bool = True,
                   attention: str = "local") -> dict:
    """`attention`: an `EngineConfig.kernels.attention_backend`, or "gpu-default": what the notebooks pick on a GPU for
    this folder (`notebook_model.attention_backend`)."""
    cfg = EngineConfig(use_megatron_fsdp=fsdp, tensor_model_parallel_size=tp, dtype="fp32", seed=3,
                       override_transformer_config=transformer or {})
    rt = runtime.init(cfg)
    src = f"{workdir}/{arch}_v{vocab_size}"
    if rt.rank == 0 and not os.path.exists(f"{src}/config.json"):
        archs.write_tiny(arch, src, vocab_size=vocab_size, **(overrides or {}))
    dist.barrier()
    if attention == "gpu-default":
        from mfsdp_kit.notebook.model import attention_backend
        attention = attention_backend(src, on_gpu=True, env={})
    if attention != cfg.kernels.attention_backend:
        cfg = dataclasses.replace(cfg, kernels=dataclasses.replace(cfg.kernels, attention_backend=attention))
        runtime.init(cfg)
    model = hf_models.load(src, cfg)
    v = verify(model)
    greedy = greedy_vs_hf(model, src, vocab_size=vocab_size)
    result = dict(greedy=greedy, wrapper=type(model.chunks[0]).__name__, verify=v.as_dict(), attention=attention,
                  padded_vocab=model.config.vocab_size if hasattr(model.config, "vocab_size") else None,
                  megatron_vocab=engine.unwrap_model(model.chunks[0]).vocab_size)
    from safetensors.torch import load_file
    original = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            original.update(load_file(f"{src}/{f}"))
    exported = dict(sync.export_hf_weights(model.chunks, model.bridge))
    result.update(export_names_match=sorted(exported) == sorted(original),
                  export_shapes_match=all(exported[k].shape == original[k].shape for k in original if k in exported),
                  export_maxdiff=max((exported[k].float() - original[k].float()).abs().max().item()
                                     for k in original if k in exported and exported[k].shape == original[k].shape))
    if train:
        opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-2), cfg)
        batch = random_token_batches(steps=1, global_batch=4, seq_len_tokens=16, vocab_size=vocab_size, seed=9)[0]
        result["hf_loss"] = hf_loss(src, batch)
        result["megatron_loss"] = forward_backward(model.chunks, batch, micro_batch_size=2, forward_only=True)[0]
        r = step(model.chunks, opt, batch, micro_batch_size=2)
        trained = dict(sync.export_hf_weights(model.chunks, model.bridge))
        result.update(loss=r.loss, changed_by_step=sum(not torch.equal(trained[k], original[k]) for k in original),
                      trained_shapes_match=all(trained[k].shape == original[k].shape for k in original))
        out = f"{workdir}/saved_{arch}_v{vocab_size}_tp{tp}_{'fsdp' if fsdp else 'ddp'}"
        sync.save_hf(model.chunks, model.bridge, out)
        tokens = fixed_tokens(vocab_size).to(rt.device)   # transformers reloads on the same device
        live = logits(model.chunks, tokens, vocab_size=vocab_size)
        if rt.rank == 0:  # transformers reloads the trained folder: its logits are Megatron's
            diff = (hf_logits(out, tokens) - live).abs().max().item()
            result.update(reload_vs_megatron_maxdiff=diff, reload_relative=diff / live.abs().max().item())
    runtime.shutdown()
    return result


def arch_roundtrips(*, archs: list[str], **kwargs) -> dict:
    """arch_roundtrip for each architecture in turn, in this one world: {arch: result}."""
    return {arch: arch_roundtrip(arch=arch, **kwargs) for arch in archs}


def verify_detects(*, workdir: str, fsdp: bool = False) -> dict:
    """load(verify=True) passes on a faithful model; a model changed after loading is caught."""
    from mfsdp_kit.models.verify import VerificationError
    cfg = EngineConfig(use_megatron_fsdp=fsdp, dtype="fp32", seed=3)
    rt = runtime.init(cfg)
    src = f"{workdir}/LlamaForCausalLM_verify"
    if rt.rank == 0 and not os.path.exists(f"{src}/config.json"):
        archs.write_tiny("LlamaForCausalLM", src)
    dist.barrier()
    import time
    t0 = time.perf_counter()
    model = hf_models.load(src, cfg, verify=True)
    seconds = time.perf_counter() - t0
    good = model.verification.as_dict()
    with torch.no_grad():  # a silent change: the final norm scaled by 1.01 on the compute weights
        for name, p in engine.unwrap_model(model.chunks[0]).named_parameters():
            if name.endswith("final_layernorm.weight"):
                p.mul_(1.01)
    bad = verify(model)
    try:
        verify(model, strict=True)
        raised = None
    except VerificationError as e:
        raised = str(e)
    runtime.shutdown()
    return dict(good=good, bad=bad.as_dict(), bad_str=str(bad), raised=raised, load_verify_s=seconds)
