"""Packed sequences and token-budget micro-batches: the padded run's numbers without computing its padding.

The naive way (`data.batches`, `rl.core.rollout_batch`) pads every sequence of a batch to one length and
cuts micro-batches of a fixed number of rows. With lengths that vary 10x, most of what the model computes
is padding: a GRPO update of 512 rows padded to 521 positions held ~82k real tokens in 267k positions.

Here (verl's `use_remove_padding` + `use_dynamic_bsz`, torchtitan's document masking) the global `Batch`
stays padded - every rank holds it, loss functions read it - but the forwards see no padding:
- `loss_lengths`: a sequence counts up to its last loss token. Attention is causal, so a later position
  changes no loss: cutting there (trailing padding, a reply's unscored tail) changes no number.
- `plan`: the sequences, longest first, go to the data-parallel rank with the fewest tokens so far, then
  into micro-batches of at most `max_tokens_per_micro_batch` tokens; every rank gets the same number of
  micro-batches (Megatron-FSDP all-gathers per forward, so the ranks must run alike) - an empty one is a
  one-token forward with no loss. Every rank computes the same plan from the same global batch.
- `pack`: one micro-batch is ONE row of its sequences end to end ([1, T], megatron's "thd" layout) with
  `PackedSeqParams` (cu_seqlens kept on the host: megatron's RoPE splits by them, a device copy would cost
  a sync per layer). megatron restarts RoPE at each sequence (`models.fusions.rope_thd` when fused);
  `models.sdpa.SDPAttention` attends within each: one varlen flash call on a GPU (`models.varlen`), one SDPA
  per sequence on CPU (`models.flex`: one flex_attention).
  The per-token losses come back scattered into the padded rows (zeros elsewhere), so a loss function gets
  exactly the tensors the padded run gives it: sums over tokens, counts over micro-batches and ranks, and
  hence the gradient (megatron's `calculate_per_token_loss`) are the padded run's within roundoff.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch

from ..distributed import runtime
from ..models import router_replay
from . import token_budget
from .data import Batch
from .options import StepOptions, takes_options
from ..fieldtypes import bad_value, is_int


def loss_lengths(batch: Batch) -> list[int]:
    """Per sequence: positions up to and including its last loss token (0: no loss token)."""
    seq = batch.loss_mask.shape[1]
    pos = torch.arange(1, seq + 1, device=batch.loss_mask.device).expand_as(batch.loss_mask)   # a GPU batch too
    return torch.where(batch.loss_mask != 0, pos, 0).amax(dim=1).tolist()


def padding_fraction(batch: Batch) -> float:
    """The share of the padded batch's positions that are padding (after each sequence's last loss token)."""
    return 1.0 - sum(loss_lengths(batch)) / max(1, batch.loss_mask.numel())


def plan(lengths: list[int], *, dp_size: int, max_tokens_per_micro_batch: int) -> list[list[list[int]]]:
    """[rank][micro-batch] -> sequence indices: balanced over ranks by tokens, at most the budget per
    micro-batch, the same number of micro-batches on every rank (some possibly empty)."""
    budget = max_tokens_per_micro_batch
    if not (is_int(budget) and budget >= max(lengths, default=1)):
        raise bad_value("max_tokens_per_micro_batch", budget, f"an integer >= the longest sequence's "
                        f"{max(lengths, default=1)} tokens (a sequence is never split)")
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    ranks, load = [[] for _ in range(dp_size)], [0] * dp_size
    for i in order:
        r = min(range(dp_size), key=lambda r: (load[r], r))
        ranks[r].append(i)
        load[r] += lengths[i]
    k = max(1, max(len(_first_fit(seqs, lengths, budget)) for seqs in ranks))
    return [_in_bins(seqs, lengths, budget, k) for seqs in ranks]


def _first_fit(seqs: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: the fewest bins this greedy finds (`seqs` longest first)."""
    bins, load = [], []
    for i in seqs:
        b = next((b for b, used in enumerate(load) if used + lengths[i] <= budget), len(bins))
        if b == len(bins):
            bins.append([])
            load.append(0)
        bins[b].append(i)
        load[b] += lengths[i]
    return bins


def _in_bins(seqs: list[int], lengths: list[int], budget: int, k: int) -> list[list[int]]:
    """`seqs` in exactly k bins under the budget: each to the emptiest bin (even micro-batches); where that
    overflows, first-fit's bins and empty ones up to k."""
    bins, load = [[] for _ in range(k)], [0] * k
    for i in seqs:
        b = min(range(k), key=lambda b: (load[b], b))
        if load[b] + lengths[i] > budget:
            ffd = _first_fit(seqs, lengths, budget)
            return ffd + [[] for _ in range(k - len(ffd))]
        bins[b].append(i)
        load[b] += lengths[i]
    return bins


@dataclass
class PackedMicroBatch:
    """One packed micro-batch: its sequences end to end in one row, and the padded rows they came from."""

    rows: Batch
    """The padded rows of these sequences, as the global batch holds them: what the loss function reads."""
    indices: torch.Tensor
    """[n] each row's index in the global batch."""
    tokens: torch.Tensor
    """[1, T] the sequences' tokens end to end (T = the sum of their lengths)."""
    labels: torch.Tensor
    """[1, T] their next-token targets."""
    position_ids: torch.Tensor
    """[1, T] positions restarting at 0 for each sequence."""
    row_of_token: torch.Tensor
    """[T] which of `rows` each packed token belongs to."""
    cu_seqlens: torch.Tensor
    """[n + 1] int32 on the host: where each sequence starts in the row, and T."""
    filler: bool = False
    """An empty micro-batch's stand-in (one token, no loss): it only keeps this rank's forwards in step."""

    def to(self, device) -> "PackedMicroBatch":
        move = partial(runtime.to_device, device=device)
        return PackedMicroBatch(self.rows.to(device), move(self.indices), move(self.tokens), move(self.labels),
                                move(self.position_ids), move(self.row_of_token), self.cu_seqlens, self.filler)

    def params(self):
        """megatron's `PackedSeqParams` for this row ("thd": RoPE restarts, attention within a sequence)."""
        from megatron.core.packed_seq_params import PackedSeqParams
        longest = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=longest, max_seqlen_kv=longest)

    def flat_index(self, *, global_batch: bool = False) -> torch.Tensor:
        """[T] each packed token's index in the flattened rows [n * seq] (or the global batch's)."""
        row = self.indices[self.row_of_token] if global_batch else self.row_of_token
        return row * self.rows.tokens.shape[1] + self.position_ids[0]

    def unpack(self, per_token: torch.Tensor) -> torch.Tensor:
        """[1, T] -> [n, seq] in the padded rows' layout, zeros where the packed row has no token."""
        n, seq = self.rows.tokens.shape
        flat = per_token.new_zeros(n * seq).index_copy(0, self.flat_index(), per_token.reshape(-1))
        return flat.view(n, seq)

    def packed(self, per_token: torch.Tensor) -> torch.Tensor:
        """[n, seq, ...] in the padded rows' layout -> [1, T, ...] in this packed row's (`unpack`'s inverse)."""
        n, seq = self.rows.tokens.shape
        return per_token.reshape(n * seq, *per_token.shape[2:])[self.flat_index()].unsqueeze(0)

    def forward(self, model):
        """The model's per-token losses [1, T] on this row."""
        return model(self.tokens, self.position_ids, None, labels=self.labels, packed_seq_params=self.params())


@contextmanager
def routes_replayed(chunks, batch: Batch):
    """The forwards over `batch`'s micro-batches inside, each started by `replay_routes`; after them the routers go
    back to their own choice (nothing to undo when the batch carries no routes)."""
    try:
        yield
    finally:
        if "routes" in batch.extras:
            router_replay.clear(chunks)


def replay_routes(chunks, mb) -> None:
    """Route a micro-batch's next forward by the MoE routes it carries (`extras["routes"]`, in its padded or packed
    layout: `models.router_replay`); nothing without them."""
    packed = isinstance(mb, PackedMicroBatch)
    routes = (mb.rows if packed else mb).extras.get("routes")
    if routes is not None:
        router_replay.set_routes(chunks, mb.packed(routes) if packed else routes)


def pack(batch: Batch, indices: list[int], lengths: list[int]) -> PackedMicroBatch:
    """Sequences `indices` of `batch`, each its first `lengths[i]` tokens, as one packed row. No indices: a
    one-token row of sequence 0 with its loss mask cleared (a forward that adds nothing to any sum)."""
    if not indices:
        rows = batch.slice(0, 1)
        rows = Batch(rows.tokens, rows.labels, torch.zeros_like(rows.loss_mask), rows.extras)
        filler = _packed(rows, torch.zeros(1, dtype=torch.long), [1])
        filler.filler = True
        return filler
    idx = torch.tensor(indices, dtype=torch.long)
    rows = Batch(batch.tokens[idx], batch.labels[idx], batch.loss_mask[idx], {k: v[idx] for k, v in batch.extras.items()})
    return _packed(rows, idx, [lengths[i] for i in indices])


def _packed(rows: Batch, idx: torch.Tensor, lens: list[int]) -> PackedMicroBatch:
    keep = torch.arange(rows.tokens.shape[1]).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    row_of_token = torch.arange(len(lens)).repeat_interleave(torch.tensor(lens))
    positions = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    return PackedMicroBatch(rows, idx, rows.tokens[keep].unsqueeze(0), rows.labels[keep].unsqueeze(0), positions,
                            row_of_token, cu)


def unpacked_loss(loss_fn, mb: PackedMicroBatch, per_token: torch.Tensor):
    """megatron's loss_func on a packed micro-batch: `loss_fn` on the padded rows and their per-token losses."""
    return loss_fn(mb.rows, mb.unpack(per_token))


def loss_func(loss_fn, mb):
    """The loss_func megatron's schedule calls with the model's output for micro-batch `mb` (packed or padded)."""
    return partial(unpacked_loss, loss_fn, mb) if isinstance(mb, PackedMicroBatch) else partial(loss_fn, mb)


# ---- which path a call takes ----------------------------------------------------------------
def can_pack(chunks) -> bool:
    """Does this model take packed rows? Its core attention must be the kit's SDPA (megatron's local
    `DotProductAttention` asserts packed_seq_params is None) and there is one pipeline stage (packed
    micro-batches differ in shape, megatron's pipeline sends fixed shapes)."""
    from megatron.core import parallel_state as ps
    from ..models.sdpa import SDPAttention
    if ps.get_pipeline_model_parallel_world_size() > 1:
        return False
    cores = [m for c in chunks for m in c.modules() if type(m).__name__.endswith("DotProductAttention")
             or isinstance(m, SDPAttention)]
    return bool(cores) and all(isinstance(m, SDPAttention) for m in cores)


@takes_options
def budget(chunks, batch: Batch, *, options: StepOptions, forward_only: bool = False) -> int | None:
    """The token budget of a packed call with `options` (`StepOptions`, or its fields as keywords), or None for the
    padded path.

    packed None: packed where the model can (`can_pack`; where it cannot, `padded_note` says why once), else
    padded; True: packed or an error; False: padded. The default budget comes from the device's memory
    (`token_budget.memory_budget`: what the activations of a training or of a no-grad micro-batch may take), at
    least the batch's row length; on CPU it is `micro_batch_size` rows of the batch's length."""
    if options.packed is False:
        return None
    if not can_pack(chunks):
        if options.packed or options.max_tokens_per_micro_batch is not None:
            raise bad_value("packed", True, "False, or a model with attention_backend='sdpa' and "
                            "pipeline_model_parallel_size=1 (packed rows need the kit's SDPA attention)")
        padded_note(chunks)
        return None
    if options.max_tokens_per_micro_batch is not None:
        return options.max_tokens_per_micro_batch
    tokens = token_budget.memory_budget(chunks, forward_only=forward_only)
    seq = batch.tokens.shape[1]
    return options.micro_batch_size * seq if tokens is None else max(tokens, seq)


def padded_note(chunks) -> None:
    """One line on rank 0, once per model: why its micro-batches are padded."""
    from megatron.core import parallel_state as ps
    if getattr(chunks[0], "_kit_padded_noted", False):
        return
    chunks[0]._kit_padded_noted = True
    if ps.get_pipeline_model_parallel_world_size() > 1:
        why = "pipeline_model_parallel_size > 1 (megatron's pipeline sends fixed shapes)"
    else:
        why = ("megatron's 'local' attention takes no packed rows (kernels.attention_backend='auto' picks it on CPU "
               "and for sliding-window models; 'sdpa' packs)")
    if runtime.current().rank == 0:
        print(f"mfsdp_kit: padded micro-batches: {why}", flush=True)


def largest_packed(mbs: list) -> int | None:
    """Tokens of the largest of these micro-batches if they are packed (None: padded rows, or none)."""
    if not mbs or not all(isinstance(mb, PackedMicroBatch) for mb in mbs):
        return None
    return max(mb.tokens.numel() for mb in mbs)


def rank_micro_batches(batch: Batch, *, max_tokens_per_micro_batch: int) -> list[PackedMicroBatch]:
    """This data-parallel rank's packed micro-batches of the global `batch` (`plan`, then `pack`)."""
    from megatron.core import parallel_state as ps
    lengths = loss_lengths(batch)
    mine = plan(lengths, dp_size=ps.get_data_parallel_world_size(),
                max_tokens_per_micro_batch=max_tokens_per_micro_batch)[ps.get_data_parallel_rank()]
    return [pack(batch, seqs, lengths) for seqs in mine]


@torch.no_grad()
def token_logprobs(chunks, batch: Batch, *, max_tokens_per_micro_batch: int) -> torch.Tensor:
    """`rl.core.token_logprobs` on packed rows: log p(label) [n, seq] of the whole batch on every rank (each
    sequence is computed by one rank, then summed over the data-parallel group); 0 after a sequence's last
    loss token and on rows without one."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    device = runtime.current().device
    out = torch.zeros(batch.tokens.numel(), device=device)
    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    with routes_replayed(chunks, batch):
        for mb in rank_micro_batches(batch, max_tokens_per_micro_batch=max_tokens_per_micro_batch):
            mb = mb.to(device)
            replay_routes(chunks, mb)
            losses = mb.forward(chunks[0])
            if not mb.filler:
                out[mb.flat_index(global_batch=True)] = -losses.float().reshape(-1)
    for c, mode in zip(chunks, was_training):
        c.train(mode)
    dist.all_reduce(out, group=ps.get_data_parallel_group())
    return out.view(batch.tokens.shape).cpu()
