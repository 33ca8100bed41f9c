"""HF -> Megatron (DDP | Megatron-FSDP) -> HF round trip: logits parity, exact export, export
throughput, one training step, FSDP-vs-DDP export equality, save_hf + reload.

    torchrun --nproc_per_node 2 bench/roundtrip.py --size m --dtype bf16 --out runs/bench/roundtrip.json
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/roundtrip.py --size xs --dtype fp32

`roundtrip(...)` is also the body of the CPU test (tests/models/test_hf.py).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from mfsdp_kit import engine, runtime, sync
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.data import random_token_batches
from mfsdp_kit.models.hf import load
from mfsdp_kit.models.tiny import tiny
from mfsdp_kit.train import step

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@torch.no_grad()
def megatron_logits(chunks, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    for c in chunks:
        c.eval()
    out = chunks[0](tokens, torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens), None)
    for c in chunks:
        c.train()
    return gather_from_tensor_model_parallel_region(out)[..., :vocab].float()


def roundtrip(*, arch: str, size: str, tp: int, fsdp: bool, dtype: str, workdir: str) -> dict:
    import transformers
    from safetensors.torch import save_file
    cfg = EngineConfig(use_megatron_fsdp=fsdp, tensor_model_parallel_size=tp, dtype=dtype, seed=3)
    rt = runtime.init(cfg)
    src = f"{workdir}/src_{arch}_{size}"
    if rt.rank == 0 and not os.path.exists(f"{src}/config.json"):
        tiny(src, arch=arch, size=size, seed=1)
    dist.barrier()
    model = load(src, cfg)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=DTYPES[dtype]).to(rt.device).eval()
    vocab = hf.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(5)).to(rt.device)
    with torch.no_grad():
        ref_logits = hf(tokens).logits.float()
    result = dict(wrapper=type(model.chunks[0]).__name__,
                  logits_maxdiff=(megatron_logits(model.chunks, tokens, vocab) - ref_logits).abs().max().item())
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
    live = megatron_logits(model.chunks, tokens, vocab)
    if rt.rank == 0:
        save_file(trained, f"{out}.exported.safetensors")
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=DTYPES[dtype]).to(rt.device).eval()
        with torch.no_grad():
            result["reload_vs_megatron_maxdiff"] = (reloaded(tokens).logits.float() - live).abs().max().item()
        result["exported_file"] = f"{out}.exported.safetensors"
    del model, opt, hf
    runtime.shutdown()
    return result


def _fmt(value) -> str:
    return f"{value:.3e}" if isinstance(value, float) else str(value)


def main() -> None:
    from safetensors.torch import load_file
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available()
    ap.add_argument("--size", default="m" if gpu else "xs")
    ap.add_argument("--arch", default="qwen2")
    ap.add_argument("--dtype", default="bf16" if gpu else "fp32")
    ap.add_argument("--workdir", default="/tmp/mfsdp_roundtrip")
    ap.add_argument("--out", default="runs/bench/roundtrip.json")
    args = ap.parse_args()
    runs = {mode: roundtrip(arch=args.arch, size=args.size, tp=1, fsdp=mode == "fsdp", dtype=args.dtype,
                            workdir=args.workdir) for mode in ("ddp", "fsdp")}
    if dist.get_rank() != 0:
        return
    a, b = load_file(runs["ddp"]["exported_file"]), load_file(runs["fsdp"]["exported_file"])
    fsdp_vs_ddp = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    print(f"\nround trip, {args.arch} {args.size}, {args.dtype}, world {dist.get_world_size()}")
    keys = ["logits_maxdiff", "export_maxdiff", "export_names_match", "changed_by_step",
            "reload_vs_megatron_maxdiff", "export_bytes", "export_s", "export_gbps"]
    print(f"{'':28}{'DDP':>16}{'FSDP':>16}")
    for k in keys:
        print(f"{k:<28}" + "".join(f"{_fmt(runs[m][k]):>16}" for m in ("ddp", "fsdp")))
    print(f"FSDP vs DDP export after one step: max|diff| {fsdp_vs_ddp:.3e}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(args=vars(args), runs=runs, fsdp_vs_ddp_after_step=fsdp_vs_ddp), f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
