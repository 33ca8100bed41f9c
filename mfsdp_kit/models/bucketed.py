"""Packed rows through dense SDPA: the row's sequences grouped by length, right-padded within a group.

`models.varlen` runs a packed row through FlashAttention-2's varlen kernels, which reached ~140 TFLOP/s on
1 H200 where SDPA's dense causal kernels (cuDNN on Hopper) reach ~350-400 on the padded rows
(docs/benchmarks.md, packing). cuDNN's own ragged path is no way around it there: torch 2.11's
`_cudnn_attention_forward` with sequence bounds ran at 0.4 TFLOP/s with NaN gradients. Here the sequences
(longest first) are split into at most `max_groups` runs of similar lengths (`groups`: the split that computes
the fewest padded score entries), each run gathered into [n, heads, L, hn] with L its longest and sent through
dense causal SDPA, and the real tokens gathered back in the row's order.

Exact for real tokens: padding only follows a sequence's last token, and under a causal mask a real query
sees only keys at or before it, all real. A padded slot repeats its sequence's last token (any finite value
would do); its output is dropped, so its gradient is zero.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def groups(lens: list[int], *, max_groups: int = 4) -> list[list[int]]:
    """Sequence indices in at most `max_groups` groups of consecutive lengths (longest first) that minimise the
    padded score entries, sum over groups of n x longest^2 (dynamic programming over the sorted lengths)."""
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    n = len(order)
    k = max(1, min(max_groups, n))
    inf = float("inf")
    # best[g][j]: the least cost of the first j sequences (sorted) in g groups; a group [a, j) costs
    # (j - a) x lens[order[a]]^2 (its first is its longest)
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for g in range(1, k + 1):
        for j in range(1, n + 1):
            for a in range(g - 1, j):
                cost = best[g - 1][a] + (j - a) * lens[order[a]] ** 2
                if cost < best[g][j]:
                    best[g][j], cut[g][j] = cost, a
    g = min(range(1, k + 1), key=lambda g: best[g][n])
    bounds, j = [], n
    while g:
        bounds.append((cut[g][j], j))
        j, g = cut[g][j], g - 1
    return [order[a:b] for a, b in reversed(bounds)]


def gather_plan(lens: list[int], *, max_groups: int = 4) -> tuple[list[tuple[Tensor, int, int]], Tensor]:
    """Host index tensors for `attention`: per group (row positions of its [n x L] padded slots, n, L), and
    each row token's slot in the groups' outputs laid end to end."""
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    plan, slot_of_token, offset = [], torch.empty(sum(lens), dtype=torch.long), 0
    for members in groups(lens, max_groups=max_groups):
        longest = max(lens[i] for i in members)
        pos = torch.arange(longest)
        rows = [starts[i] + pos.clamp(max=lens[i] - 1) for i in members]
        plan.append((torch.cat(rows), len(members), longest))
        for j, i in enumerate(members):
            slot_of_token[starts[i]:starts[i] + lens[i]] = offset + j * longest + torch.arange(lens[i])
        offset += len(members) * longest
    return plan, slot_of_token


def device_plan(params, device: torch.device):
    """`gather_plan` of `params.cu_seqlens_q` (host) on `device`, made once per `params` (every layer of a
    forward shares it) and copied through pinned memory, so no layer waits on the host."""
    cached = getattr(params, "_mfsdp_groups", None)
    if cached is None or cached[1].device != device:
        from ..runtime import to_device
        cu = params.cu_seqlens_q.tolist()
        plan, slots = gather_plan([b - a for a, b in zip(cu[:-1], cu[1:])])
        cached = ([(to_device(rows, device), n, longest) for rows, n, longest in plan], to_device(slots, device))
        params._mfsdp_groups = cached
    return cached


def attention(query: Tensor, key: Tensor, value: Tensor, params, *, causal: bool, scale: float,
              dropout_p: float) -> Tensor:
    """[t, h, hn] attention within each sequence of the packed row `params` describes (grouped KV heads as
    they are); [t, h, hn] out. Without `causal` a padded key would be seen: refused."""
    if not causal:
        raise NotImplementedError("length-grouped attention needs a causal mask (padding follows real tokens)")
    plan, slots = device_plan(params, query.device)
    outs = []
    for rows, n, longest in plan:
        q, k, v = (x.index_select(0, rows).view(n, longest, *x.shape[1:]).transpose(1, 2) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=longest > 1, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        outs.append(out.transpose(1, 2).reshape(n * longest, *query.shape[1:]))
    return torch.cat(outs).index_select(0, slots)
