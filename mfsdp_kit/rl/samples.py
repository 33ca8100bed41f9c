"""What an RL iteration samples and the training batch it becomes: `RolloutBatch` (the scored samples of the whole
global batch, with what the rollout backend said of each: log-probs, model mask, MoE routes), `concat` of several,
and `rollout_batch` (prompt + completion rows, the loss on the completion's model tokens). `rl.core` re-exports
them; `collect` makes a RolloutBatch, `training_batch` adds the old and reference log-probs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import bad_value
from ..fieldtypes import is_int
from ..train import Batch
from .rollout.tools import joined_masks


@dataclass(kw_only=True)
class RolloutBatch:
    """Scored samples of the whole global batch, identical on every rank, in group-major order:
    completion i answers prompt i // group_size."""

    prompts: list[tuple[str, str]]
    """(prompt, answer) per group."""
    prompt_ids: list[list[int]]
    """Token ids of each group's prompt."""
    completions: list[list[int]]
    """Sampled token ids (cut after eos), num_groups * group_size of them."""
    rewards: torch.Tensor
    """[num_groups * group_size] float rewards."""
    solved: torch.Tensor
    """[num_groups * group_size] bool: the reward's own `solved` convention."""
    group_size: int
    stats: dict = field(default_factory=dict)
    """sync_s, sync_bytes (when refreshed), rollout_s."""
    logprobs: list[list[float]] | None = None
    """Per completion, each sampled token's log-prob as the rollout backend computed it (at the sampling
    temperature), or None if the backend does not score: the train-inference mismatch (`scoring.mismatch`). With
    tools, of the model's tokens only."""
    model_mask: list[list[int]] | None = None
    """Per completion, 1 per token the model sampled, 0 per token a tool wrote (out of the loss); None: all model."""
    routes: list[torch.Tensor] | None = None
    """With `router_replay`: per completion, its tokens' MoE routes [tokens, moe_layers, k] (`rl.rollout.routes`)."""
    versions: list[list[int]] | None = None
    """Per completion, the policy version of each of its tokens (the trainer's optimizer steps when the token was
    sampled): one value throughout for a completion sampled in one go, several for one continued across iterations
    (partial rollouts) or sampled ahead of the trainer (decoupled rollouts); None: every token is the current
    policy's."""

    @property
    def num_groups(self) -> int:
        return len(self.prompts)

    def select_groups(self, groups: list[int]) -> "RolloutBatch":
        """The batch restricted to the given group indices (in that order)."""
        rows = [g * self.group_size + j for g in groups for j in range(self.group_size)]
        return RolloutBatch(prompts=[self.prompts[g] for g in groups], prompt_ids=[self.prompt_ids[g] for g in groups],
                            completions=[self.completions[i] for i in rows], rewards=self.rewards[rows],
                            solved=self.solved[rows], group_size=self.group_size, stats=dict(self.stats),
                            logprobs=None if self.logprobs is None else [self.logprobs[i] for i in rows],
                            model_mask=None if self.model_mask is None else [self.model_mask[i] for i in rows],
                            routes=None if self.routes is None else [self.routes[i] for i in rows],
                            versions=None if self.versions is None else [self.versions[i] for i in rows])


def concat(batches: list[RolloutBatch]) -> RolloutBatch:
    """Groups of several batches in order; stats: seconds and bytes summed."""
    stats: dict = {}
    for b in batches:
        for k, v in b.stats.items():
            stats[k] = stats.get(k, 0) + v
    return RolloutBatch(prompts=[p for b in batches for p in b.prompts],
                        prompt_ids=[p for b in batches for p in b.prompt_ids],
                        completions=[c for b in batches for c in b.completions],
                        rewards=torch.cat([b.rewards for b in batches]), solved=torch.cat([b.solved for b in batches]),
                        group_size=batches[0].group_size, stats=stats,
                        logprobs=None if any(b.logprobs is None for b in batches) else
                        [lp for b in batches for lp in b.logprobs],
                        model_mask=joined_masks([b.model_mask for b in batches], [b.completions for b in batches]),
                        routes=None if any(b.routes is None for b in batches) else [r for b in batches for r in b.routes],
                        versions=None if any(b.versions is None for b in batches) else
                        [v for b in batches for v in b.versions])


def rollout_batch(prompt_ids: list[list[int]], completions: list[list[int]], advantages: torch.Tensor, *,
                  seq_len_tokens: int, pad_id: int, model_mask: list[list[int]] | None = None,
                  routes: list[torch.Tensor] | None = None) -> Batch:
    """Sequences prompt + completion as a training Batch; loss only on completion tokens the model sampled
    (`model_mask`, None: all; a tool's output is context, not an action). `prompt_ids` has one entry per
    completion. old/ref log-probs start as zeros. `routes` (per completion, [tokens, moe_layers, k]): the
    trainer's forwards replay them (`extras["routes"]`, expert 0 on padding; `models.router_replay`)."""
    n = len(completions)
    tokens = torch.full((n, seq_len_tokens), pad_id, dtype=torch.long)
    labels, mask = tokens.clone(), torch.zeros(n, seq_len_tokens)
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        if len(p) + len(c) - 1 > seq_len_tokens:   # cut, its last tokens would leave the loss without a word
            raise bad_value("seq_len_tokens", seq_len_tokens, f"an integer >= {len(p) + len(c) - 1}: rollout {i} "
                            f"has a {len(p)}-token prompt and a {len(c)}-token completion")
        ids = p + c
        tokens[i, :len(ids) - 1] = torch.tensor(ids[:-1])
        labels[i, :len(ids) - 1] = torch.tensor(ids[1:])
        mask[i, len(p) - 1:len(ids) - 1] = 1.0 if model_mask is None else torch.tensor(model_mask[i]).float()
    zeros = torch.zeros(n, seq_len_tokens)
    extras = dict(advantages=advantages.float(), old_logprobs=zeros, ref_logprobs=zeros.clone())
    if routes is not None:   # the fed tokens' routes: all but the last, as `tokens` holds
        extras["routes"] = torch.zeros(n, seq_len_tokens, *routes[0].shape[1:], dtype=routes[0].dtype)
        for i, r in enumerate(routes):
            extras["routes"][i, :len(prompt_ids[i]) + len(completions[i]) - 1] = r[:-1]
    return Batch(tokens, labels, mask, extras)


def prompt_ids(tokenizer, prompts: list[tuple[str, str]]) -> list[list[int]]:
    """The token ids of each (prompt, answer)'s prompt, as the training batch holds them (the template's own
    special tokens are in the text already)."""
    return tokenizer([p for p, _ in prompts], add_special_tokens=False)["input_ids"]


def seq_len_needed(prompts: list[tuple[str, str]], tokenizer, *, max_new_tokens: int) -> int:
    """The shortest `seq_len_tokens` that holds every rollout of `prompts` [(prompt, answer)] whole: the longest
    prompt's tokens (`prompt_ids`, as `collect` encodes them) + `max_new_tokens`, less the token nothing predicts."""
    return max(map(len, prompt_ids(tokenizer, prompts))) + max_new_tokens - 1


def checked_seq_len(seq_len_tokens: int | None, prompts: list[tuple[str, str]], tokenizer, *,
                    max_new_tokens: int) -> int:
    """`seq_len_tokens`, or `seq_len_needed` when it is None. One too short for the prompt pool is refused before
    any rollout: a chat template's system turn makes prompts longer than the tokens of their question."""
    need = seq_len_needed(prompts, tokenizer, max_new_tokens=max_new_tokens)
    if seq_len_tokens is None:
        return need
    if not is_int(seq_len_tokens) or seq_len_tokens < need:
        raise bad_value("seq_len_tokens", seq_len_tokens, f"None (= {need}) or an integer >= {need}: the longest prompt "
                        f"of prompt_pool has {need + 1 - max_new_tokens} tokens, max_new_tokens={max_new_tokens}")
    return seq_len_tokens
