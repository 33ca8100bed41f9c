"""The algorithm-independent pieces of policy-gradient RL on the kit's chunks.

Every RL algorithm here composes five functions, called in the open by the one `rl.loop.iteration`:

    collect          sync weights into the rollout backend, sample n completions per prompt on each
                     data-parallel rank, score them -> a `RolloutBatch` (the same on every rank)
    group_advantages A = (r - mean(r)) / (std(r) + eps) within each prompt's group of n
    training_batch   prompt + completion as a training `Batch` (loss on completion tokens), with the
                     log-probs of the sampled tokens under the current model (`old`) and a reference
    update           `epochs` passes of `num_minibatches` optimizer steps, each with a loss_fn
    aggregate        how a loss_fn reduces its per-token losses: the normaliser of the gradient

Why the normaliser is the loss_fn's to choose: megatron divides the gradient by the SUM of the
counts the loss_fn returns over micro-batches and data-parallel ranks (`train.py`). Return
(sum over tokens, token count) and the loss is the token-level mean of the minibatch,
    L = sum_i sum_t l_it / sum_i |o_i|;
return (sum_i mean_t l_it, number of sequences) and it is the mean of per-sequence means,
    L = (1/G) sum_i (1/|o_i|) sum_t l_it,
which is the GRPO paper's; a long completion then weighs as much as a short one in total, so
each of its tokens weighs less. The kit's GRPO has always used the token level (`rl.algorithms.grpo`).

Each algorithm (`rl.algorithms`) adds its config, its loss and, where it has them, its filter and estimator.
"""
from __future__ import annotations

import inspect
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.distributed as dist

from ..distributed import offload, runtime, stop
from ..config import bad_value
from ..perf.timeline import phase
from .advantages import ADV_EPS, Estimator, group_advantages  # noqa: F401 (core's public names)
from .correction import Mode, rollout_logprobs_like
from .metrics import rollout_metrics, update_metrics  # noqa: F401 (core's public names)
from .samples import (RolloutBatch, checked_seq_len, concat, prompt_ids, rollout_batch,  # noqa: F401
                      seq_len_needed)  # (core's public names)
from .rewards import Reward, as_reward  # noqa: F401 (core's public names)
from ..fieldtypes import COUNT, INDEX, check_fields, checked_args, number_in, optional
from ..train import Batch, StepResult, data_parallel_slice, micro_batches, run_steps
from ..train.options import StepOptions, takes_options
from .rollout import RolloutBackend
from .rollout.placement import ReplicaPlacement
from .rollout.tools import joined_masks

# ---- rewards ---------------------------------------------------------------------------------
@dataclass(kw_only=True)
class RolloutConfig:
    """The knobs every policy-gradient method here shares: sampling, the update loop, offload. Each algorithm's
    config adds its own (`rl.algorithms`: GRPOConfig, DAPOConfig, RLOOConfig, ReinforcePPConfig, PPOConfig)."""

    prompts_per_iteration: int = 8
    """Distinct prompts (groups) per iteration (a multiple of the data-parallel size)."""
    samples_per_prompt: int = 4
    """Completions per prompt: the group whose rewards are normalised together."""
    max_new_tokens: int = 6
    """Tokens each completion may add after its prompt (sampling stops earlier at a stop id)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts. Below 1 keeps the samples near the mode, which helps where accuracy
    is scored on the greedy answer (docs/benchmarks.md, "GRPO on GPU")."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1.0 = all)."""
    score_at_temperature: bool = True
    """Score old, reference and current log-probs at the sampling temperature (logits / T, verl's convention:
    the ratio then compares the law the samples came from, and the rollout's log-probs can be checked against
    the trainer's, `rl.scoring`); False: at T 1."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference model (0 = no reference forward)."""
    ppo_epochs: int = 1
    """Passes of the policy update over each iteration's samples."""
    num_minibatches: int = 1
    """Optimizer steps per PPO epoch: the iteration's samples are cut into this many minibatches."""
    recompute_old_logprobs: bool = False
    """Run a separate no-grad forward for pi_old's log-probs before the update even when the update is one
    optimizer step. False: with one step (`ppo_epochs` x `num_minibatches` == 1) the update's own forward gives
    them (`rl.on_policy`: the same numbers, one forward pass fewer); with more steps the pass runs anyway."""
    micro_batch_size: int = 8
    """Sequences per micro-batch of the log-prob and update passes (`train.StepOptions`, as all three here): the
    same gradient at any size, fewer FSDP all-gathers when larger."""
    max_tokens_per_micro_batch: int | None = None
    """Tokens per packed micro-batch of the update (None: from the device's memory); the log-prob passes, which keep
    no activations, take their own larger budget (`scoring_options`)."""
    packed: bool | None = None
    """Pack the log-prob and update passes: None where the model can (`packing.can_pack`), True, False."""
    advantage_estimator: Estimator = "grpo"
    """How rewards become advantages (`rl.advantages`): within each group (grpo), leave-one-out (rloo), or whitened
    over the batch (reinforce++); RLOOConfig and ReinforcePPConfig fix theirs, PPO's GAE does not read it."""
    rollout_correction: Mode = "none"
    """Importance weights pi_old / q for the train-inference mismatch (`rl.correction`): "token-truncate",
    "token-mask", "sequence-truncate", "sequence-mask", or "none"."""
    correction_low: float = 0.5
    """The masks' lower bound on a weight (the truncations ignore it)."""
    correction_high: float = 2.0
    """The cap of the truncations, and the masks' upper bound."""
    router_replay: bool = False
    """MoE models: the trainer's forwards route each token to the experts the rollout chose for it (the kit's engine
    records them; `models.router_replay`), so no routing flip adds to the train-rollout mismatch."""
    partial_fraction: float | None = None
    """Partial rollouts (`rl.partial`): the share of the groups in flight (prompts_per_iteration / partial_fraction
    of them, rounded up to a multiple of the data-parallel size) whose completion ends an iteration's sampling; the
    rows still running are kept (tokens, their log-probs and policy versions) and continued next iteration, and each
    iteration trains on its first prompts_per_iteration complete groups. None: off, every group sampled to its end.
    Needs the kit's engine (ContinuousRollout), without tools or router_replay."""
    max_staleness: int = 1
    """Partial rollouts: the most policy versions (one per iteration's policy update) a token may lag the policy it
    is trained under; a row holding an older token starts again from its prompt (History's stale_rows_dropped). 0:
    no token of an earlier iteration trains (unfinished rows are sampled again from their prompts)."""
    seed: int = 0
    """Seed of the rollouts' sampling (each iteration and rank derives its own from it)."""
    offload_during_rollout: bool = False
    """Move the training state (weights, grads, Adam) to host memory while the rollout model
    samples, and back before the update (`offload.offload` / `offload.reload`)."""

    def __post_init__(self):
        """Checked when made (each field's type, `fieldtypes.check_fields`), not in the
        middle of the first iteration."""
        check_fields(self, prompts_per_iteration=COUNT, samples_per_prompt=COUNT, max_new_tokens=COUNT,
                     ppo_epochs=COUNT, num_minibatches=COUNT, micro_batch_size=COUNT, seed=INDEX, max_staleness=INDEX,
                     partial_fraction=optional(number_in(0, 1, low_open=True)),
                     max_tokens_per_micro_batch=optional(COUNT),
                     temperature=number_in(0, low_open=True), top_p=number_in(0, 1, low_open=True),
                     kl_coef=number_in(0), correction_low=number_in(0, 1), correction_high=number_in(1))
        if self.partial_fraction is not None and self.router_replay:   # a row cut mid-call keeps no routes
            raise bad_value("partial_fraction", self.partial_fraction, "None with router_replay=True (a row continued "
                            "across iterations has no routes of its earlier tokens)")

    def step_options(self, **more) -> StepOptions:
        """The update's `train.StepOptions`: this config's micro-batch fields, and `more` (loss_fn, scheduler)."""
        return StepOptions(**{"micro_batch_size": self.micro_batch_size, "packed": self.packed,
                              "max_tokens_per_micro_batch": self.max_tokens_per_micro_batch, **more})

    def scoring_options(self) -> StepOptions:
        """The no-grad passes' options (log-probs, values): the update's rows and packing, their own token budget."""
        return self.step_options(max_tokens_per_micro_batch=None)


# ---- collect ---------------------------------------------------------------------------------
def synced(*, chunks, bridge, backend: RolloutBackend) -> dict:
    """The training weights copied into `backend` (`RolloutBackend.refresh`): {sync_s, sync_bytes}."""
    t0 = time.perf_counter()
    with phase("sync"):
        nbytes = backend.refresh(chunks, bridge)["bytes"]
    return dict(sync_s=time.perf_counter() - t0, sync_bytes=nbytes)


def rollout_seed(*, seed: int, iteration: int, round: int = 0) -> int:
    """Base sampling seed of one collect (`collect` adds the data-parallel rank). Round 0 is the
    seed GRPO has always used; dynamic sampling's later rounds are offset by 101 each."""
    return seed * 100_003 + iteration * 1009 + round * 101


@contextmanager
def offloaded(chunks, optimizer):
    """Training state (weights, grads, Adam) in host memory inside the block (`offload`)."""
    offload.offload(chunks, optimizer)
    try:
        yield
    finally:
        offload.reload(chunks, optimizer)


def no_pipeline() -> None:
    """Pipeline parallelism refused before any work: rollouts split and gather by data-parallel rank, wrong across
    pipeline stages."""
    from megatron.core import parallel_state as ps
    pp = ps.get_pipeline_model_parallel_world_size()
    if pp > 1:
        raise bad_value("pipeline_model_parallel_size", pp, "1 for RL (its rollouts split and gather by "
                        "data-parallel rank, which pipeline stages would each repeat)")


def check_records_routes(backend, *, routes: bool) -> None:
    """Refuse `router_replay` (before any work) on a backend whose `sample` records no MoE routes."""
    if routes and "routes" not in inspect.signature(backend.sample).parameters:
        raise bad_value("router_replay", True, "False, or a rollout backend that records MoE routes (the kit's "
                        "ContinuousRollout)")


def sample_and_reward(backend, prompts: list[tuple[str, str]], *, n: int, max_new_tokens: int, temperature: float,
                      top_p: float, seed: int, reward: Reward, routes: bool = False) -> tuple[list, list[float]]:
    """`backend`'s `n` completions of each of `prompts` (with their MoE routes when `routes`), and the reward of each
    one's text: one replica's sampling, no collective."""
    completions = backend.sample([p for p, _ in prompts], n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                                 top_p=top_p, seed=seed, **({"routes": True} if routes else {}))
    texts = [backend.tokenizer.decode(c) for c in completions]
    return completions, [reward(prompts[i // n][0], t) for i, t in enumerate(texts)]


@stop.stoppable(then_interrupt="a rollout")   # it holds collectives: Stop lets it finish
def collect(*, chunks, bridge, backend: RolloutBackend, prompts: list[tuple[str, str]], reward: Reward | Callable,
            samples_per_prompt: int, max_new_tokens: int, temperature: float, top_p: float, seed: int,
            refresh: bool = True, offload_optimizer=None, routes: bool = False) -> RolloutBatch:
    """Sync (if `refresh`), sample `samples_per_prompt` completions for this data-parallel rank's
    share of `prompts` (same list on every rank) with seed `seed + dp_rank`, score them with
    `reward` (a `Reward`, or a plain callable: `as_reward`), gather.

    `offload_optimizer`: move the training state to the host while sampling (`offloaded`); `routes`: keep MoE routes."""
    no_pipeline()
    check_records_routes(backend, routes=routes)
    reward = as_reward(reward)
    stats = synced(chunks=chunks, bridge=bridge, backend=backend) if refresh else {}
    placement = getattr(backend, "placement", None) or ReplicaPlacement()
    share = placement.share(prompts)
    t0 = time.perf_counter()
    with phase("rollout"), offloaded(chunks, offload_optimizer) if offload_optimizer is not None else nullcontext():
        completions, rewards = sample_and_reward(backend, share, n=samples_per_prompt, max_new_tokens=max_new_tokens,
                                                 temperature=temperature, top_p=top_p, seed=seed + placement.replica(),
                                                 reward=reward, routes=routes)
    stats["rollout_s"] = time.perf_counter() - t0
    parts = placement.gather((list(completions), getattr(completions, "logprobs", None), rewards,
                              getattr(completions, "model_mask", None), getattr(completions, "routes", None)))
    rewards_t = torch.tensor([r for _, _, part, *_ in parts for r in part])
    scored = all(lp is not None for _, lp, *_ in parts)
    return RolloutBatch(prompts=list(prompts), prompt_ids=prompt_ids(backend.tokenizer, prompts),
                        completions=[c for part, *_ in parts for c in part], rewards=rewards_t,
                        solved=reward.solved(rewards_t), group_size=samples_per_prompt, stats=stats,
                        logprobs=[lp for _, part, *_ in parts for lp in part] if scored else None,
                        model_mask=joined_masks([m for *_, m, _ in parts], [c for c, *_ in parts]),
                        routes=[r for *_, part in parts for r in part] if routes else None)


# ---- the training batch and its log-probs ----------------------------------------------------
@torch.no_grad()
@takes_options
def token_logprobs(chunks, batch: Batch, *, options: StepOptions) -> torch.Tensor:
    """log p(label) per position [n, seq] for the whole batch: each data-parallel rank computes
    its slice, then the slices are summed over the data-parallel group (mini-batches later
    re-slice the batch, so every rank needs every row). Packed or padded as `options` (`train.StepOptions`, or its
    fields as keywords) say (`packing.token_logprobs`: 0 after each sequence's last loss token)."""
    from megatron.core import parallel_state as ps

    from ..train import packing
    if (budget := packing.budget(chunks, batch, options=options, forward_only=True)) is not None:
        return packing.token_logprobs(chunks, batch, max_tokens_per_micro_batch=budget)
    device, micro_batch_size = runtime.current().device, options.micro_batch_size
    local = data_parallel_slice(batch)
    out = torch.zeros(batch.tokens.shape)
    start = ps.get_data_parallel_rank() * local.num_sequences
    with packing.routes_replayed(chunks, batch):
        for i, mb in enumerate(micro_batches(local.to(device), micro_batch_size)):
            positions = torch.arange(mb.tokens.shape[1], device=device).expand_as(mb.tokens)
            for c in chunks:
                c.eval()
            packing.replay_routes(chunks, mb)
            losses = chunks[0](mb.tokens, positions, None, labels=mb.labels)
            for c in chunks:
                c.train()
            rows = slice(start + i * micro_batch_size, start + (i + 1) * micro_batch_size)
            out[rows] = -losses.float().cpu()
    out = out.to(device)
    dist.all_reduce(out, group=ps.get_data_parallel_group())
    return out.cpu()


@takes_options
@checked_args(seq_len_tokens=COUNT)
def training_batch(rollouts: RolloutBatch, advantages: torch.Tensor, *, chunks, ref_chunks, seq_len_tokens: int,
                   pad_id: int, options: StepOptions, old: bool = True) -> Batch:
    """`rollout_batch` plus old log-probs (the current model, before the update) and reference log-probs
    (`ref_chunks`; None: a copy of old, so the KL term is 0 at the first step), as `token_logprobs` says with
    `options`. `old=False`: neither is made here (the update's forward gives pi_old, `rl.on_policy`) but the
    reference model's, and the rollout's own log-probs ride along as "rollout_logprobs"."""
    n = rollouts.group_size
    batch = rollout_batch([rollouts.prompt_ids[i // n] for i in range(len(rollouts.completions))],
                          rollouts.completions, advantages, seq_len_tokens=seq_len_tokens, pad_id=pad_id,
                          model_mask=rollouts.model_mask, routes=rollouts.routes)
    if not old:
        del batch.extras["old_logprobs"], batch.extras["ref_logprobs"]
        if rollouts.logprobs is not None:
            batch.extras["rollout_logprobs"] = rollout_logprobs_like(rollouts.logprobs, batch.loss_mask)
        if ref_chunks is not None:
            batch.extras["ref_logprobs"] = token_logprobs(ref_chunks, batch, options=options)
        return batch
    batch.extras["old_logprobs"] = token_logprobs(chunks, batch, options=options)
    if ref_chunks is not None:
        batch.extras["ref_logprobs"] = token_logprobs(ref_chunks, batch, options=options)
    else:
        batch.extras["ref_logprobs"] = batch.extras["old_logprobs"].clone()
    return batch


# ---- loss reduction and the update loop ------------------------------------------------------
LossLevel = Literal["token", "sequence"]


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, *, level: LossLevel) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, count) a megatron loss_func returns; megatron divides the summed sums by the
    summed counts over the minibatch (all micro-batches, all data-parallel ranks):

        "token":    (sum_i sum_t m_it l_it,          sum_i sum_t m_it)   -> per-token mean
        "sequence": (sum_i sum_t m_it l_it / |o_i|,  #{i : |o_i| > 0})   -> mean of per-sequence means

    with |o_i| = sum_t m_it the loss tokens of sequence i."""
    lengths = mask.sum(dim=1)
    if level == "token":
        return (per_token * mask).sum(), mask.sum()
    if level == "sequence":
        return ((per_token * mask).sum(dim=1) / lengths.clamp(min=1)).sum(), (lengths > 0).float().sum()
    raise bad_value("level", level, "'token' | 'sequence'")


@takes_options
@checked_args(epochs=COUNT, num_minibatches=COUNT)
def update(*, chunks, optimizer, batch: Batch, epochs: int, num_minibatches: int,
           options: StepOptions) -> list[StepResult]:
    """`epochs` passes over the batch, each `num_minibatches` optimizer steps on consecutive slices (`train.run_steps`
    with `options`: the algorithm's loss_fn, packed or padded micro-batches, a scheduler stepped once per optimizer
    step; each step issued before the last is read)."""
    per_mb = batch.num_sequences // num_minibatches
    minibatches = (batch.slice(m * per_mb, (m + 1) * per_mb) for _ in range(epochs) for m in range(num_minibatches))
    return run_steps(chunks, optimizer, minibatches, options=options)


# ---- the outer loop --------------------------------------------------------------------------
class PromptDraw:
    """Deterministic prompt picks from a pool: each `draw(k)` is a fresh permutation's first k."""

    def __init__(self, pool: list[tuple[str, str]], *, seed: int):
        self.pool, self.rng = pool, torch.Generator().manual_seed(seed)

    def __call__(self, k: int) -> list[tuple[str, str]]:
        return [self.pool[i] for i in torch.randperm(len(self.pool), generator=self.rng)[:k].tolist()]
