"""Partial rollouts (2 gloo ranks, `rl.partial`): with partial_fraction 1 they sample what the synchronous loop
samples; without updates, the versions of the pool's tokens and the staleness bound over iterations; GRPO with
partial rollouts and the rollout correction through `loop.fit`, end to end."""
from __future__ import annotations

import dataclasses

import torch

from mfsdp_kit.config import OptimConfig
from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.rl import core, grpo, loop, partial
from mfsdp_kit.rl.algorithms import registration
from mfsdp_kit.rl.rollout import ContinuousRollout, DecodeConfig
from mfsdp_kit.train import data
from scenarios_rl import _sft_start

CFG = grpo.GRPOConfig(prompts_per_iteration=4, samples_per_prompt=4, max_new_tokens=6, micro_batch_size=8,
                      partial_fraction=0.5, max_staleness=1, rollout_correction="token-truncate")


def _parity(models, prompts, reward) -> dict:
    """One collect of the synchronous loop and one partial sample with partial_fraction 1, same iteration index."""
    once = registration.sample_once(models, dataclasses.replace(CFG, partial_fraction=None),
                                    draw=core.PromptDraw(prompts, seed=0), reward=reward, index=3).kept
    full = partial.sample(models, dataclasses.replace(CFG, partial_fraction=1.0), pool=partial.Pool(),
                          draw=core.PromptDraw(prompts, seed=0), reward=reward, index=3)
    b = full.kept
    return dict(same_completions=b.completions == once.completions, same_logprobs=b.logprobs == once.logprobs,
                same_rewards=torch.equal(b.rewards, once.rewards), same_prompts=b.prompts == once.prompts,
                versions=sorted({v for row in b.versions for v in row}), metrics=full.metrics)


def _versions(models, prompts, reward, *, max_staleness: int, iterations: int = 5) -> dict:
    """`iterations` partial samples from one pool without updates: per iteration the trained batch's groups and
    versions, and the pool's versions left."""
    pool, cfg, out = partial.Pool(), dataclasses.replace(CFG, max_staleness=max_staleness), []
    draw = core.PromptDraw(prompts, seed=1)
    for it in range(iterations):
        s = partial.sample(models, cfg, pool=pool, draw=draw, reward=reward, index=it)
        out.append(dict(groups=s.kept.num_groups, rows=len(s.kept.completions), metrics=s.metrics,
                        versions=s.kept.versions, ended=[len(c) for c in s.kept.completions],
                        pool_versions=[r.versions for g in pool.groups for r in g.rows],
                        pool_groups=len(pool.groups)))
    return dict(iterations=out)


def partial_rollouts(*, workdir: str, iterations: int = 4) -> dict:
    import transformers
    cfg, src, tok, model, task = _sft_start(workdir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    rollout = ContinuousRollout(hf, tok, config=DecodeConfig(max_batch_size=16, check_every=1, slot_bucket=8))
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-3), cfg)
    models = loop.Models(chunks=model.chunks, optimizer=opt, bridge=model.bridge, rollout=rollout)
    prompts, reward = task.rl_prompts(80), core.as_reward(data.verify)
    result = dict(parity=_parity(models, prompts, reward),
                  stale0=_versions(models, prompts, reward, max_staleness=0),
                  stale1=_versions(models, prompts, reward, max_staleness=1))
    history = loop.fit(models=models, cfg=CFG, prompt_pool=prompts, reward_fn=data.verify, iterations=iterations,
                       seq_len_tokens=16, progress=False)
    result["history"] = {k: v for k, v in vars(history).items() if v}
    runtime.shutdown()
    return result
