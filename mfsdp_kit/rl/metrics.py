"""What an RL iteration reports of its rollouts and its update (`core` re-exports both; this module imports nothing of
the kit, so `core` can)."""
from __future__ import annotations


def rollout_metrics(rollouts) -> dict:
    """Of a `core.RolloutBatch`: reward (mean), accuracy (share solved), response_tokens (mean completion length),
    response_tokens_max, prompt_tokens (mean prompt length per completion), tool_call_rate (share of completions
    holding a tool's output)."""
    lengths = [len(c) for c in rollouts.completions]
    called = [0 in m for m in rollouts.model_mask or []]
    return dict(reward=rollouts.rewards.mean().item(), accuracy=rollouts.solved.float().mean().item(),
                response_tokens=sum(lengths) / len(lengths), response_tokens_max=max(lengths),
                prompt_tokens=sum(map(len, rollouts.prompt_ids)) / rollouts.num_groups,
                tool_call_rate=sum(called) / len(lengths))


def update_metrics(results) -> dict:
    """Of `core.update`'s `train.StepResult`s: the last optimizer step's loss and the loss_fn's logged kl, clip_frac,
    entropy."""
    last = results[-1].metrics
    return dict(kl=last["kl"], clip_frac=last["clip_frac"], entropy=last["entropy"], loss=results[-1].loss)
