"""Scenarios of the critic-free algorithms of rl.algorithms (2 gloo ranks), through the one loop as a user runs them:
the SFT'd tiny policy (`scenarios_rl._sft_start`), one iteration whose loss shows which advantages it trained on,
then a few iterations of `loop.fit`."""
from __future__ import annotations

import torch
import transformers

from mfsdp_kit.distributed import engine, runtime
from mfsdp_kit.config import OptimConfig
from mfsdp_kit.rl import advantages, core, grpo, loop
from mfsdp_kit.rl.algorithms import ReinforcePPConfig, RLOOConfig, of
from mfsdp_kit.train import data
from scenarios_rl import _sft_start, _shards

CONFIGS = {"rloo": RLOOConfig, "reinforce++": ReinforcePPConfig}


def _token_mean(adv: torch.Tensor, completions: list[list[int]]) -> float:
    """-sum_i A_i |o_i| / sum_i |o_i|: the token-level loss at ratio 1 without KL (every completion token of row i
    has A_i)."""
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.float64)
    return (-(adv.double() * lengths).sum() / lengths.sum()).item()


def critic_free_end_to_end(*, workdir: str, algorithm: str, iterations: int = 2) -> dict:
    """One iteration at one optimizer step (pi_old from the update's forward: ratio exactly 1, so its loss is
    `_token_mean` of the advantages it trained on) beside the registration's estimate on the same rollouts (same
    seed, same weights) and GRPO's, all raised to 0 (`min_advantage`: a zero-sum estimate over completions of
    one length would give the loss 0 whatever the estimator); then `iterations` of `loop.fit` from there."""
    engine_cfg, src, tok, model, task = _sft_start(workdir)
    rollout = grpo.Rollout(transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), tok)
    opt = engine.build_optimizer(model.chunks, OptimConfig(lr=1e-3), engine_cfg)
    models = loop.Models(chunks=model.chunks, optimizer=opt, bridge=model.bridge, rollout=rollout)
    cfg = CONFIGS[algorithm](prompts_per_iteration=8, samples_per_prompt=4, max_new_tokens=4, micro_batch_size=8,
                             min_advantage=0.0)
    pool, registration = task.rl_prompts(80), of(cfg)
    sampled = registration.sample(models, cfg, draw=core.PromptDraw(pool, seed=0), reward=core.as_reward(data.verify),
                                  index=0)
    kept = sampled.kept
    estimate = registration.advantages(kept, cfg, models=models, seq_len_tokens=16, pad_id=tok.pad_token_id)
    group = advantages.group_advantages(kept.rewards, group_size=4).clamp(min=0.0)
    before = _shards(model.chunks)
    m = loop.iteration(models=models, cfg=cfg, draw=core.PromptDraw(pool, seed=0), reward_fn=data.verify,
                       seq_len_tokens=16, index=0)
    history = loop.fit(models=models, cfg=cfg, prompt_pool=pool, reward_fn=data.verify, iterations=iterations,
                       seq_len_tokens=16, progress=False)
    result = dict(name=registration.name, rewards=kept.rewards.tolist(), advantages=estimate.advantages.tolist(),
                  reward_of_iteration=[m["reward"], kept.rewards.mean().item()], loss=m["loss"],
                  loss_by_hand=_token_mean(estimate.advantages, kept.completions),
                  loss_with_grpo=_token_mean(group, kept.completions),
                  weights_changed=any(not torch.equal(a, b) for a, b in zip(before, _shards(model.chunks))),
                  history=vars(history))
    runtime.shutdown()
    return result
