"""Greedy decoding with the Megatron model itself, and held-out exact-match accuracy.

Deliberately plain: each new token re-runs the forward over the whole sequence (no KV cache);
answers here are a few tokens. With Megatron-FSDP every forward all-gathers parameters, so
every data-parallel rank must run the same number of forwards: prompts are grouped by length
in the same order on every rank, each group is padded to a multiple of the DP size, and each
rank decodes its share. A row ends at the first of the tokenizer's stop ids (`chat.stop_ids`: eos
and the template's end-of-turn, e.g. <|im_end|> or <|eot_id|>), and decoding ends once every row
on every data-parallel rank has ended (one all-reduce of a flag per token). (Fast sampling for RL is
the rollout engine's: `rl.rollout.ContinuousRollout`.)
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from . import chat, packing
from ..distributed import engine, keep_gathered, runtime
from ..models import vocab
from .data import Batch
from ..fieldtypes import COUNT, bad_value, checked_args, optional


@torch.no_grad()
def logits(chunks, tokens: torch.Tensor, *, last_only: bool = False, vocab_size: int | None = None,
           lengths: list[int] | None = None) -> torch.Tensor:
    """The model's fp32 logits for `tokens` [batch, seq]: [batch, seq, vocab] (or [batch, 1, vocab]
    with `last_only`), the same full vocabulary on every tensor-parallel rank.

    The output layer is vocab-parallel: each TP rank computes logits for its slice of the
    vocabulary, so the forward is followed by an all-gather over the TP group (`last_only` gathers
    only the last position, all greedy decoding needs). Megatron pads the vocabulary to a multiple
    of 128 * TP; `vocab_size` cuts the padding off. The chunks run in eval mode (no dropout) and go
    back to the mode they were in. With Megatron-FSDP the forward all-gathers parameters, so every
    data-parallel rank must call this as often as the others; afterwards
    `engine.settle_param_gathers(chunks)` finishes what the forward prefetched (greedy does).

    `lengths`: row i is its first lengths[i] tokens, the rest padding. The rows then run packed end to end
    in one forward where the model takes packed rows (`packing.can_pack`), padded otherwise (causal: the
    padding changes no real position); logits past a row's length are 0 and `last_only` gives each row's
    last real position.

    `tokens` may be on any device: they go to the runtime's device here, where they first meet the model
    (megatron's embedding indexes its GPU table with them), and the logits come back on `tokens`' device, so
    a caller comparing with a CPU model (peft, transformers) needs no `.cpu()`.

    The device, eval mode and gather are `models.vocab.full_logits`'s (what `models.verify` compares); the forward,
    packed or cut to `lengths`, is this module's.
    """
    if lengths is not None and packing.can_pack(chunks):
        def forward(t):
            return _packed_logits(chunks, t, lengths=lengths, last_only=last_only)
    else:
        def forward(t):
            return _at_lengths(vocab.forward_padded(chunks, t), lengths, last_only=last_only)
    return vocab.full_logits(chunks, tokens, vocab_size=vocab_size, forward=forward)


def _row_batch(tokens: torch.Tensor, lengths: list[int]) -> Batch:
    """`tokens` as a Batch whose loss mask ends each row at its length (what `packing` cuts at)."""
    if len(lengths) != tokens.shape[0] or not all(1 <= n <= tokens.shape[1] for n in lengths):
        raise bad_value("lengths", lengths, f"{tokens.shape[0]} integers in [1, {tokens.shape[1]}], one per row")
    mask = (torch.arange(tokens.shape[1]) < torch.tensor(lengths).unsqueeze(1)).float()
    return Batch(tokens.cpu(), tokens.cpu(), mask)


def _packed_logits(chunks, tokens: torch.Tensor, *, lengths: list[int], last_only: bool) -> torch.Tensor:
    """[b, seq or 1, vocab / tp] from one forward over the rows packed end to end."""
    mb = packing.pack(_row_batch(tokens, lengths), list(range(len(lengths))), lengths).to(tokens.device)
    out = chunks[0](mb.tokens, mb.position_ids, None, packed_seq_params=mb.params())[0]   # [T, vocab / tp]
    if last_only:
        return out[(mb.cu_seqlens[1:] - 1).long().to(out.device)].unsqueeze(1)
    full = out.new_zeros(tokens.shape[0] * tokens.shape[1], out.shape[-1])
    full[mb.flat_index()] = out
    return full.view(tokens.shape[0], tokens.shape[1], -1)


def _at_lengths(out: torch.Tensor, lengths: list[int] | None, *, last_only: bool) -> torch.Tensor:
    """Padded logits [b, seq, v] as `logits` returns them: zero past each row's length, or its last position."""
    if lengths is None:
        return out[:, -1:, :] if last_only else out
    mask = _row_batch(out[..., 0], lengths).loss_mask.to(out.device)
    if last_only:
        return out[torch.arange(out.shape[0], device=out.device), torch.tensor(lengths, device=out.device) - 1].unsqueeze(1)
    return out * mask.unsqueeze(-1).to(out.dtype)


def _my_share(items: list, *, dp_rank: int, dp_size: int) -> tuple[list, int]:
    """This rank's equal-sized slice of `items` (padded by repeating the last item), and how
    many of its entries are real (the rest are padding to drop)."""
    per_rank = -(-len(items) // dp_size)
    padded = items + [items[-1]] * (per_rank * dp_size - len(items))
    real = max(0, min(per_rank, len(items) - dp_rank * per_rank))
    return padded[dp_rank * per_rank:(dp_rank + 1) * per_rank], real


def cut_at_stop(row: list[int], stop_ids) -> list[int]:
    """`row` up to and including its first stop id (all of it if it has none)."""
    stops = {stop_ids} if isinstance(stop_ids, int) else set(stop_ids)
    return next((row[:j + 1] for j, t in enumerate(row) if t in stops), row)


def _all_stopped(tokens: torch.Tensor, start: int, stops: torch.Tensor) -> bool:
    """Has every row of every data-parallel rank produced a stop id since `start`? (All ranks agree.)"""
    from megatron.core import parallel_state as ps
    open_rows = (~torch.isin(tokens[:, start:], stops).any(dim=1)).sum().reshape(1).float()
    dist.all_reduce(open_rows, group=ps.get_data_parallel_group())
    return open_rows.item() == 0


@torch.no_grad()
@checked_args(max_new_tokens=COUNT, vocab_size=optional(COUNT))
def greedy(chunks, prompts: list[list[int]], *, max_new_tokens: int, stop_ids: int | list[int],
           vocab_size: int | None = None) -> dict[int, list[int]]:
    """Greedy completions (token ids, cut after the first stop id) for THIS rank's share:
    {prompt index: ids}. `stop_ids`: e.g. `chat.stop_ids(tokenizer)`; `vocab_size` keeps argmax
    off megatron's padded vocabulary rows."""
    from megatron.core import parallel_state as ps
    if ps.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError("greedy decoding with the Megatron model needs pipeline_model_parallel_size=1")
    device = runtime.current().device
    stops = torch.tensor([stop_ids] if isinstance(stop_ids, int) else list(stop_ids), dtype=torch.long, device=device)
    by_length = defaultdict(list)
    for i, p in enumerate(prompts):
        by_length[len(p)].append(i)
    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    out = {}
    with keep_gathered.held(chunks):   # built with fsdp_keep_gathered: one gather per unit per call, not per token
        for length in sorted(by_length):
            share, real = _my_share(by_length[length], dp_rank=ps.get_data_parallel_rank(),
                                    dp_size=ps.get_data_parallel_world_size())
            tokens = torch.tensor([prompts[i] for i in share], device=device)
            for _ in range(max_new_tokens):  # every rank runs the same forwards: all stop together
                next_ids = logits(chunks, tokens, last_only=True, vocab_size=vocab_size)[:, -1, :].argmax(dim=-1)
                tokens = torch.cat([tokens, next_ids.unsqueeze(1)], dim=1)
                if _all_stopped(tokens[:real], length, stops):   # padding rows (beyond real) do not count
                    break
            for i, row in zip(share[:real], tokens[:real, length:].tolist()):
                out[i] = cut_at_stop(row, stop_ids)
        engine.settle_param_gathers(chunks)
    for c, mode in zip(chunks, was_training):
        c.train(mode)
    return out


@checked_args(max_new_tokens=COUNT, vocab_size=optional(COUNT))
def evaluate(chunks, tokenizer, prompts_answers: list[tuple[str, str]], *, reward_fn,
             max_new_tokens: int = 8, vocab_size: int | None = None, stop_ids: list[int] | None = None) -> dict:
    """Held-out accuracy: mean `reward_fn(prompt, completion)` over all prompts (all ranks agree).
    Completions stop at `stop_ids`, by default the tokenizer's eos and its chat template's
    end-of-turn token (`chat.stop_ids`; a model's generation_config may list more)."""
    from megatron.core import parallel_state as ps
    ids = [chat.encode_text(tokenizer, p) for p, _ in prompts_answers]
    completions = greedy(chunks, ids, max_new_tokens=max_new_tokens, vocab_size=vocab_size,
                         stop_ids=chat.stop_ids(tokenizer) if stop_ids is None else stop_ids)
    score = torch.zeros(2, dtype=torch.float64, device=runtime.current().device)
    samples = []
    for i, row in sorted(completions.items()):
        text = tokenizer.decode(row)
        score[0] += reward_fn(prompts_answers[i][0], text)
        score[1] += 1
        samples.append((prompts_answers[i][0], text))
    dist.all_reduce(score, group=ps.get_data_parallel_group())
    return dict(accuracy=(score[0] / score[1]).item(), n=int(score[1].item()), samples=samples[:4])
