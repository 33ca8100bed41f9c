"""GRPO at notebook scale: rollouts from synced FSDP weights, verifiable rewards, policy update.

One iteration:
  1. sync      every chunk's weights -> the HF rollout model on each rank (`sync.load_into`,
               between `synchronize_fsdp_params` and `restore_fsdp_params`)
  2. rollout   each data-parallel rank samples n completions for its share of the prompts
               (transformers `generate`, KV cache, temperature / top-p)
  3. reward    `reward_fn(prompt, completion) -> float` (any callable; default: exact match)
  4. advantage per prompt group: A = (r - mean(r)) / (std(r) + eps), eps = 1e-6 so a group
               whose samples all scored alike gets A = 0 instead of a division by zero
  5. update    log-probs of the sampled tokens recomputed by the Megatron model (`old`, before
               the update), clipped-ratio loss, optional k3 KL to a frozen reference model,
               `ppo_epochs` passes over `num_minibatches` mini-batches.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from .. import engine, offload, runtime, sync
from ..train import Batch, data_parallel_slice, micro_batches, step

ADV_EPS = 1e-6


@dataclass(kw_only=True)
class GRPOConfig:
    """Knobs of one GRPO run."""

    prompts_per_iteration: int = 8
    """Distinct prompts per iteration (a multiple of the data-parallel size)."""
    samples_per_prompt: int = 4
    """Completions per prompt: the group whose rewards are normalised together."""
    max_new_tokens: int = 6
    temperature: float = 1.0
    """Sampling temperature of the rollouts. Below 1 keeps the samples near the mode: where accuracy
    is scored on the greedy answer, T 0.5 raised it +11.5 points in 180 iterations on GPU, where T 1
    raised only the samples' own accuracy (docs/benchmarks.md, GRPO)."""
    top_p: float = 1.0
    clip_eps: float = 0.2
    """Ratio clip: the loss stops pushing once ratio leaves [1 - clip_eps, 1 + clip_eps]."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference model (0 = no reference forward)."""
    ppo_epochs: int = 1
    num_minibatches: int = 1
    micro_batch_size: int = 8
    seed: int = 0
    min_advantage: float | None = None
    """Advantages below this are raised to it (None = plain GRPO). 0.0 keeps only the better-than-
    group-mean samples: they are pushed up, the worse ones are left alone instead of pushed down."""
    offload_during_rollout: bool = False
    """Move the training state (weights, grads, Adam) to host memory while the rollout model
    samples, and back before the update (`offload.offload` / `offload.reload`)."""


def group_advantages(rewards: torch.Tensor, *, group_size: int, eps: float = ADV_EPS) -> torch.Tensor:
    """[num_prompts * group_size] rewards -> advantages normalised within each prompt's group."""
    groups = rewards.view(-1, group_size).float()
    mean, std = groups.mean(dim=1, keepdim=True), groups.std(dim=1, unbiased=False, keepdim=True)
    return ((groups - mean) / (std + eps)).reshape(-1)


def grpo_loss(mb: Batch, token_losses: torch.Tensor, *, clip_eps: float, kl_coef: float):
    """megatron loss_func for GRPO: token_losses = -log p_theta(sampled token)."""
    mask = mb.loss_mask.float()
    logp = -token_losses.float()
    ratio = torch.exp(logp - mb.extras["old_logprobs"])
    adv = mb.extras["advantages"].unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    delta = mb.extras["ref_logprobs"] - logp
    kl = torch.exp(delta) - delta - 1  # k3 estimator: >= 0, unbiased for KL(pi || ref)
    if kl_coef:
        per_token = per_token + kl_coef * kl
    loss_sum = (per_token * mask).sum()
    count = mask.sum()
    clip_frac = ((ratio - clipped).abs() > 0).float()
    logged = {"lm loss": torch.stack([loss_sum.detach(), count]),
              "kl": torch.stack([(kl.detach() * mask).sum(), count]),
              "clip_frac": torch.stack([(clip_frac * mask).sum(), count]),
              "entropy": torch.stack([(-logp.detach() * mask).sum(), count])}  # sampled-token estimate
    return loss_sum, count.to(torch.int), logged


class Rollout:
    """An HF model on this rank's device, refreshed from the training chunks, that samples."""

    def __init__(self, hf_model, tokenizer):
        self.model, self.tokenizer = hf_model.eval(), tokenizer
        self.tokenizer.padding_side = "left"  # batched generation appends on the right

    def refresh(self, chunks, bridge) -> dict:
        """Copy the current training weights in (every chunk); returns time and bytes."""
        engine.synchronize_fsdp_params(chunks)
        stats = sync.load_into(self.model, chunks, bridge)
        engine.restore_fsdp_params(chunks)
        return stats

    @torch.no_grad()
    def sample(self, prompts: list[str], *, n: int, max_new_tokens: int, temperature: float, top_p: float,
               seed: int) -> list[list[int]]:
        """n completions (token ids, cut after eos) per prompt, in prompt-major order."""
        if not prompts:
            return []
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        enc = {k: enc[k].to(self.model.device) for k in ("input_ids", "attention_mask")}
        torch.manual_seed(seed)  # TP ranks of one replica draw the same samples
        out = self.model.generate(**enc, do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                                  max_new_tokens=max_new_tokens, num_return_sequences=n,
                                  eos_token_id=self.tokenizer.eos_token_id,
                                  pad_token_id=self.tokenizer.pad_token_id)
        completions = []
        for row in out[:, enc["input_ids"].shape[1]:].tolist():
            eos = self.tokenizer.eos_token_id
            completions.append(row[:row.index(eos) + 1] if eos in row else row)
        return completions


def rollout_batch(prompt_ids: list[list[int]], completions: list[list[int]], advantages: torch.Tensor, *,
                  seq_len_tokens: int, pad_id: int) -> Batch:
    """Sequences prompt + completion as a training Batch; loss only on completion tokens."""
    n = len(completions)
    tokens = torch.full((n, seq_len_tokens), pad_id, dtype=torch.long)
    labels, mask = tokens.clone(), torch.zeros(n, seq_len_tokens)
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        ids = (p + c)[:seq_len_tokens + 1]
        tokens[i, :len(ids) - 1] = torch.tensor(ids[:-1])
        labels[i, :len(ids) - 1] = torch.tensor(ids[1:])
        mask[i, len(p) - 1:len(ids) - 1] = 1.0
    zeros = torch.zeros(n, seq_len_tokens)
    return Batch(tokens, labels, mask, dict(advantages=advantages.float(), old_logprobs=zeros,
                                            ref_logprobs=zeros.clone()))


@torch.no_grad()
def token_logprobs(chunks, batch: Batch, *, micro_batch_size: int) -> torch.Tensor:
    """log p(label) per position [n, seq] for the whole batch: each data-parallel rank computes
    its slice, then the slices are summed over the data-parallel group (mini-batches later
    re-slice the batch, so every rank needs every row)."""
    from megatron.core import parallel_state as ps
    device = runtime.current().device
    local = data_parallel_slice(batch)
    out = torch.zeros(batch.tokens.shape)
    start = ps.get_data_parallel_rank() * local.num_sequences
    for i, mb in enumerate(micro_batches(local.to(device), micro_batch_size)):
        positions = torch.arange(mb.tokens.shape[1], device=device).expand_as(mb.tokens)
        for c in chunks:
            c.eval()
        losses = chunks[0](mb.tokens, positions, None, labels=mb.labels)
        for c in chunks:
            c.train()
        rows = slice(start + i * micro_batch_size, start + (i + 1) * micro_batch_size)
        out[rows] = -losses.float().cpu()
    out = out.to(device)
    dist.all_reduce(out, group=ps.get_data_parallel_group())
    return out.cpu()


@dataclass
class GRPOHistory:
    """Per-iteration metrics."""

    reward: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    response_tokens: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    clip_frac: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    sync_s: list[float] = field(default_factory=list)
    sync_bytes: list[int] = field(default_factory=list)
    rollout_s: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)


def _gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def iteration(*, chunks, optimizer, bridge, rollout: Rollout, prompts: list[tuple[str, str]], reward_fn,
              gcfg: GRPOConfig, seq_len_tokens: int, ref_chunks=None, index: int = 0, scheduler=None) -> dict:
    """One GRPO iteration over `prompts` [(prompt, answer)] (same list on every rank); `scheduler`
    (e.g. `engine.build_scheduler`, for a warm-up) steps once per optimizer step."""
    from megatron.core import parallel_state as ps
    metrics = {}
    t0 = time.perf_counter()
    stats = rollout.refresh(chunks, bridge)
    metrics.update(sync_s=time.perf_counter() - t0, sync_bytes=stats["bytes"])
    if gcfg.offload_during_rollout:
        offload.offload(chunks, optimizer)

    t0 = time.perf_counter()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if len(prompts) % dp:
        raise ValueError(f"prompts_per_iteration={len(prompts)} must be a multiple of the data-parallel size {dp}")
    share = prompts[dp_rank * len(prompts) // dp:(dp_rank + 1) * len(prompts) // dp]
    completions = rollout.sample([p for p, _ in share], n=gcfg.samples_per_prompt, max_new_tokens=gcfg.max_new_tokens,
                                 temperature=gcfg.temperature, top_p=gcfg.top_p,
                                 seed=gcfg.seed * 100_003 + index * 1009 + dp_rank)
    texts = [rollout.tokenizer.decode(c) for c in completions]
    rewards = [float(reward_fn(share[i // gcfg.samples_per_prompt][0], t)) for i, t in enumerate(texts)]
    metrics["rollout_s"] = time.perf_counter() - t0
    if gcfg.offload_during_rollout:
        offload.reload(chunks, optimizer)

    # every rank assembles the same global batch (TP ranks of a replica contributed identical rows)
    gathered = _gather((completions, rewards))[::runtime.current().world_size // dp]
    completions = [c for part, _ in gathered for c in part]
    rewards_t = torch.tensor([r for _, part in gathered for r in part])
    enc = rollout.tokenizer([p for p, _ in prompts], add_special_tokens=False)["input_ids"]
    prompt_ids = [enc[i // gcfg.samples_per_prompt] for i in range(len(completions))]
    adv = group_advantages(rewards_t, group_size=gcfg.samples_per_prompt)
    if gcfg.min_advantage is not None:
        adv = adv.clamp(min=gcfg.min_advantage)
    batch = rollout_batch(prompt_ids, completions, adv, seq_len_tokens=seq_len_tokens,
                          pad_id=rollout.tokenizer.pad_token_id)

    t0 = time.perf_counter()
    batch.extras["old_logprobs"] = token_logprobs(chunks, batch, micro_batch_size=gcfg.micro_batch_size)
    if ref_chunks is not None:
        batch.extras["ref_logprobs"] = token_logprobs(ref_chunks, batch, micro_batch_size=gcfg.micro_batch_size)
    else:
        batch.extras["ref_logprobs"] = batch.extras["old_logprobs"].clone()
    results = []
    per_mb = batch.num_sequences // gcfg.num_minibatches
    loss_fn = partial(grpo_loss, clip_eps=gcfg.clip_eps, kl_coef=gcfg.kl_coef)
    for _ in range(gcfg.ppo_epochs):
        for m in range(gcfg.num_minibatches):
            results.append(step(chunks, optimizer, batch.slice(m * per_mb, (m + 1) * per_mb),
                                micro_batch_size=gcfg.micro_batch_size, loss_fn=loss_fn, scheduler=scheduler))
    metrics["train_s"] = time.perf_counter() - t0
    last = results[-1].metrics
    metrics.update(reward=rewards_t.mean().item(), accuracy=(rewards_t == 1.0).float().mean().item(),
                   response_tokens=sum(len(c) for c in completions) / len(completions),
                   kl=last["kl"], clip_frac=last["clip_frac"], entropy=last["entropy"], loss=results[-1].loss)
    return metrics


def fit(*, chunks, optimizer, bridge, rollout: Rollout, prompt_pool: list[tuple[str, str]], reward_fn,
        gcfg: GRPOConfig, iterations: int, seq_len_tokens: int, ref_chunks=None, progress: bool = True,
        on_iteration=None, scheduler=None) -> GRPOHistory:
    """`iterations` GRPO iterations, cycling deterministically through `prompt_pool`.

    `on_iteration(iteration, metrics)` runs on every rank after each iteration (e.g. a held-out
    evaluation every k iterations; it may run collectives, as all ranks call it). A fresh Adam
    without warm-up takes sign-like steps of the full lr at first, which on CPU at lr 3e-5 cost a
    small SFT'd model ~5 held-out points in 15 steps even on gold SFT data: pass a `scheduler`
    with a warm-up."""
    from tqdm.auto import tqdm

    from ..progress import report
    history = GRPOHistory()
    rng = torch.Generator().manual_seed(gcfg.seed)
    bar = tqdm(range(iterations), desc="grpo", disable=not (progress and runtime.current().rank == 0))
    for it in bar:
        pick = torch.randperm(len(prompt_pool), generator=rng)[:gcfg.prompts_per_iteration].tolist()
        m = iteration(chunks=chunks, optimizer=optimizer, bridge=bridge, rollout=rollout,
                      prompts=[prompt_pool[i] for i in pick], reward_fn=reward_fn, gcfg=gcfg,
                      seq_len_tokens=seq_len_tokens, ref_chunks=ref_chunks, index=it, scheduler=scheduler)
        for key in vars(history):
            getattr(history, key).append(m[key])
        bar.set_postfix(reward=f"{m['reward']:.3f}", kl=f"{m['kl']:.4f}")
        report(step=it + 1, total=iterations, reward=m["reward"], kl=m["kl"])
        if on_iteration is not None:
            on_iteration(it, m)
    return history
