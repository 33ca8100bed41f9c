"""LoRA scenarios on the embedded tiny model and arithmetic task (run by launch.run)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from mfsdp_kit import data, engine, generate, lora, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.introspect import inner_optimizers, local
from mfsdp_kit.memory import memory_report
from mfsdp_kit.models.hf import load
from mfsdp_kit.models.tiny import tiny
from mfsdp_kit.train import step


def _sum(value: int) -> int:
    t = torch.tensor([value])
    dist.all_reduce(t)
    return int(t)


def _local_params(chunks) -> dict[str, torch.Tensor]:
    """Each parameter's local part (an FSDP shard, a TP slice), cloned; FSDP chunks show their shards first."""
    engine.synchronize_fsdp_params(chunks)
    return {f"{i}.{name}": local(p).detach().clone() for i, c in enumerate(chunks) for name, p in c.named_parameters()}


def _world(cfg: EngineConfig, workdir: str):
    rt = runtime.init(cfg)
    src = f"{workdir}/tiny_xs_lora"
    if rt.rank == 0:
        tiny(src, size="xs", seed=0)
    dist.barrier()
    return rt, src


def train_adapters(*, fsdp: bool, tp: int, workdir: str, steps: int = 3, lr: float = 1e-2) -> dict:
    """Load the tiny model twice (plain and with LoRA), compare logits, train the adapters a few steps."""
    layout = dict(use_megatron_fsdp=fsdp, tensor_model_parallel_size=tp, seed=3)
    cfg = EngineConfig(**layout, lora=lora.LoRAConfig(rank=4, alpha=8))
    rt, src = _world(cfg, workdir)
    base = load(src, EngineConfig(**layout))
    model = load(src, cfg, wrap=False)
    trainable = lora.trainable_names(model.chunks)
    trainable_numel = sum(p.numel() for c in model.chunks for p in c.parameters() if p.requires_grad)
    frozen_numel = sum(p.numel() for c in model.chunks for p in c.parameters() if not p.requires_grad)
    model.chunks = engine.wrap_chunks(cfg, model.chunks)
    tokens = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    init_diff = (generate.logits(model.chunks, tokens, vocab_size=model.vocab_size)
                 - generate.logits(base.chunks, tokens, vocab_size=model.vocab_size)).abs().max().item()
    for chunks in (model.chunks, base.chunks):
        engine.settle_param_gathers(chunks)
    engine.release(base.chunks)
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=lr, clip_grad=1.0), cfg)
    before = _local_params(model.chunks)
    batches = data.batches(data.ArithmeticTask(digits=1).train_pairs(40), _tokenizer(src), seq_len_tokens=16,
                           global_batch=8, seed=1)
    results = [step(model.chunks, opt, next(batches), micro_batch_size=2, step_index=i) for i in range(steps)]
    after = _local_params(model.chunks)
    state_numel = sum(local(t["exp_avg"]).numel() for o in inner_optimizers(opt) for t in o.optimizer.state.values())
    held = [p for o in inner_optimizers(opt) for g in o.optimizer.param_groups for p in g["params"]]
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    frozen = [name for name in before if not lora.is_adapter(name)]
    result = dict(
        wrapper=type(model.chunks[0]).__name__, init_diff=init_diff,
        losses=[r.loss for r in results], grad_norms=[float(r.grad_norm) for r in results],
        trainable=trainable, all_trainable_are_adapters=all(lora.is_adapter(n) for n in trainable),
        frozen_changed=sorted(set(frozen) & changed),
        adapters_changed=len(changed - set(frozen)), adapters=len(before) - len(frozen), optimizer_params=len(held),
        adapters_here=sum(before[n].numel() > 0 for n in before if n not in frozen),
        frozen_bit_equal=all(torch.equal(before[n], after[n]) for n in frozen),
        state_numel_all_ranks=_sum(state_numel),
        trainable_numel_all_ranks=_sum(trainable_numel), frozen_numel_all_ranks=_sum(frozen_numel),
        local_frozen_numel=_sum(sum(before[n].numel() for n in frozen)),
        dp_size=rt.world_size // tp, memory=memory_report(model.chunks, opt).as_dict())
    runtime.shutdown()
    return result


def _tokenizer(src: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(src)

