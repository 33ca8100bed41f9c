"""keep_gathered scenarios: Megatron-FSDP steps with megatron's per-micro-batch gathers or with the step's gathers
kept (`EngineConfig.wrapper.fsdp_keep_gathered`), counting the all-gathers each step really issues."""
from __future__ import annotations

import dataclasses

from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import BucketStatus

from mfsdp_kit.distributed import engine, keep_gathered, runtime
from mfsdp_kit.config import EngineConfig, OptimConfig
from mfsdp_kit.distributed.introspect import all_gather_pipelines
from mfsdp_kit.models import gpt_model_fn
from mfsdp_kit.models.gpt import MOE_SPECS
from mfsdp_kit.train.generate import greedy
from mfsdp_kit.train import step
from scenarios import SPEC, random_batches
from scenarios_grad_upcast import _weight_bits


def _count_gathers(pipeline) -> dict:
    """Count the buckets `pipeline` gathers (a call on a bucket that is not EMPTY gathers nothing)."""
    seen = {"gathers": 0, "most_gathered": 0}
    gather = pipeline.async_bucket_gather

    def counted(bucket_id, bwd):
        if pipeline.bucket_status[pipeline.get_bucket_key(bucket_id, bwd)] == BucketStatus.EMPTY:
            seen["gathers"] += 1
        result = gather(bucket_id, bwd)
        ready = sum(s != BucketStatus.EMPTY for s in pipeline.bucket_status.values())
        seen["most_gathered"] = max(seen["most_gathered"], ready)
        return result
    pipeline.async_bucket_gather = counted
    return seen


def train(*, keep: bool, dtype: str = "bf16", recompute: str = "none", layers: int = 4, steps: int = 3,
          micro_batch_size: int = 2, ep: int = 1, ddp: dict | None = None) -> dict:
    """`steps` Megatron-FSDP steps of a `layers`-layer GPT (MoE with `ep` > 1: experts split over ranks, whose
    expert buffers are then not sharded), global batch 8 (2 micro-batches of 2 per rank on 2 ranks). Returns
    losses, grad norms, this rank's main weights (bits), the buckets gathered per step, the most buckets gathered
    at once, the buckets still gathered after each step, and how many buckets the model has."""
    spec = dataclasses.replace(MOE_SPECS["moe-tiny"] if ep > 1 else SPEC, num_layers=layers)
    # padded rows of `micro_batch_size` ("local" attention): the gathers are counted per micro-batch
    cfg = EngineConfig(use_megatron_fsdp=True, dtype=dtype, recompute=recompute, seed=7, fsdp_keep_gathered=keep,
                       expert_model_parallel_size=ep, override_ddp_config=ddp or {}, attention_backend="local")
    runtime.init(cfg)
    chunks = engine.build(cfg, gpt_model_fn(spec, cfg))
    opt = engine.build_optimizer(chunks, OptimConfig(lr=3e-3, clip_grad=0.05), cfg)
    pipeline = all_gather_pipelines(chunks)[0]
    seen = _count_gathers(pipeline)
    pool = random_batches(steps=2, batch=8, seq=spec.seq_len_tokens, vocab=spec.vocab_size)
    losses, norms, gathers, after = [], [], [], []
    for i in range(steps):
        before = seen["gathers"]
        r = step(chunks, opt, pool[i % 2], micro_batch_size=micro_batch_size, step_index=i)
        losses.append(r.loss)
        norms.append(r.grad_norm)
        gathers.append(seen["gathers"] - before)
        after.append(keep_gathered.gathered_buckets(chunks))
    torch_opt = opt.optimizer if hasattr(opt, "optimizer") else opt.chained_optimizers[0].optimizer
    result = dict(losses=losses, grad_norms=norms, gathers_per_step=gathers, gathered_after_step=after,
                  most_gathered=seen["most_gathered"], buckets=pipeline.num_buckets,
                  weight_bits=_weight_bits([p for g in torch_opt.param_groups for p in g["params"]]))
    runtime.shutdown()
    return result


def generate(*, keep: bool, layers: int = 4, new_tokens: int = 6) -> dict:
    """Greedy decoding of 4 prompts with a Megatron-FSDP model: this rank's completions and the buckets gathered."""
    spec = dataclasses.replace(SPEC, num_layers=layers)
    cfg = EngineConfig(use_megatron_fsdp=True, seed=7, fsdp_keep_gathered=keep)
    runtime.init(cfg)
    chunks = engine.build(cfg, gpt_model_fn(spec, cfg))
    seen = _count_gathers(all_gather_pipelines(chunks)[0])
    prompts = [[3, 5, 7], [2, 4, 6], [9, 8, 7, 6], [1, 1, 2, 3]]
    completions = greedy(chunks, prompts, max_new_tokens=new_tokens, stop_ids=[-1])   # no stop: every token decoded
    result = dict(completions=sorted(completions.items()), gathers=seen["gathers"],
                  gathered_after=keep_gathered.gathered_buckets(chunks),
                  buckets=all_gather_pipelines(chunks)[0].num_buckets)
    runtime.shutdown()
    return result
