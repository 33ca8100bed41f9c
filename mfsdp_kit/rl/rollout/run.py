"""One `ContinuousRollout.generate` call's device work: the launches that carry out `scheduler.Scheduler`'s decisions
over the engine's cache (`runner.Cache`). The scheduler decides on the host which sequences are admitted,
which rows move, how many steps the next chunk runs and where each sequence stops; `Run` prefills, extends (a tool's
output into a paused sequence's own cache slots), copies cache rows, writes the rows' next token and position, and
replays the decode steps (`runner.Runner.step`: a CUDA graph per batch and slot bucket on a GPU, all captured when
the cache was made). `Run.loop` is the whole call: the two joined, one check point per turn of the loop.
"""
from __future__ import annotations

import time

import torch

from .decoder import extend, prefill
from .sampling import Sampler
from .scheduler import Chunk, Scheduler, Sequence
from .timing import ChunkTimer


class Run:
    """The device side of one call (module docstring); `loop()` returns the scheduler's `results()`."""

    def __init__(self, engine, state, scheduler: Scheduler, *, sample: Sampler):
        self.engine, self.state, self.scheduler, self.sample = engine, state, scheduler, sample
        self.timer = ChunkTimer(state.tok.device)

    def loop(self) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        """Per check point: resume the sequences back from their tools, admit queued ones, compact, decode a chunk."""
        s = self.scheduler
        try:
            while s.busy():
                self.extend(s.resume())
                for group in s.admit():
                    self.prefill(group)
                self.move(s.compact())
                chunk = s.next_chunk()
                if chunk is not None:
                    self.chunk(chunk)
        finally:
            s.close()
        return s.results()

    def prefill(self, group: list[Sequence]) -> None:
        """One padded prefill of the group's prompts into their cache rows; their first tokens sampled."""
        device, e, st = self.state.tok.device, self.engine, self.state
        lengths = [len(s.prompt) for s in group]
        where, lens = torch.tensor([s.row for s in group], device=device), torch.tensor(lengths, device=device)
        t0 = time.perf_counter()
        logits = prefill(e.model, padded([s.prompt for s in group]).to(device), lens, st.kv, where, st.rope,
                         head_dim=e.head_dim, clip_qkv=e.clip_qkv, windows=e.windows)
        tok, logp = self.sample(logits)
        st.tok[where], st.pos[where] = tok, lens
        self.scheduler.record(group, tok[:, None].cpu(), logp[:, None].cpu())
        e.stats["prefill_s"] += time.perf_counter() - t0

    def extend(self, items: list[tuple[Sequence, list[int], int]]) -> None:
        """The resumed sequences' [last token] + tool output prefilled from the slot of their last token (one
        `decoder.extend`); the token after each sampled."""
        if not items:
            return
        e, st = self.engine, self.state
        t0 = time.perf_counter()
        device = st.tok.device
        seqs = [s for s, _, _ in items]
        lengths = torch.tensor([len(ids) for _, ids, _ in items], device=device)
        where, first = torch.tensor([s.row for s in seqs], device=device), torch.tensor([a for *_, a in items],
                                                                                         device=device)
        logits = extend(e.model, padded([ids for _, ids, _ in items]).to(device), first, lengths, st.kv, where,
                        st.rope, head_dim=e.head_dim, clip_qkv=e.clip_qkv, windows=e.windows)
        tok, logp = self.sample(logits)
        st.tok[where], st.pos[where] = tok, first + lengths
        self.scheduler.record(seqs, tok[:, None].cpu(), logp[:, None].cpu())
        e.stats["extend_s"] += time.perf_counter() - t0

    def move(self, rows: list[int] | None) -> None:
        """Cache rows `rows` (ascending; KV, next token, position) copied to rows 0..len(rows)-1
        (`Scheduler.compact`, which has placed their sequences there), from the first row not already in place, only
        the slots they hold (up to the longest one's `length`: no step has read past it), at most half the cache's
        rows at a time (`Runner.transient_bytes` holds one layer's copy of half the rows). Piece by piece is safe in
        ascending order: the j-th row moved comes from a row >= j, so a piece writes no row that a later piece reads."""
        if rows is None:
            return
        st = self.state
        piece = max(1, (st.tok.shape[0] + 1) // 2)
        held = max(s.length for s in self.scheduler.cache[:len(rows)])
        first = next((j for j, r in enumerate(rows) if r != j), len(rows))   # rows already in place stay
        for start in range(first, len(rows), piece):
            src = torch.tensor(rows[start:start + piece], device=st.tok.device)
            to = slice(start, start + len(src))
            for k, v in st.kv:
                k[to, :, :held], v[to, :, :held] = k[src, :, :held], v[src, :, :held]
            st.tok[to], st.pos[to] = st.tok[src], st.pos[src]

    def chunk(self, chunk: Chunk) -> None:
        """The chunk's decode steps, then one read of what they sampled (the loop's only sync)."""
        st, b = self.state, chunk.batch
        if chunk.idle:   # a free row in the batch decodes junk at slot 0 of its own row until it is refilled
            st.pos[torch.tensor(chunk.idle, device=st.pos.device)] = 0
        sampled, head = [], self.engine.model.lm_head
        for slots in chunk.slots:
            hidden = self.engine.runner.step(b, slots)()
            tok, logp = self.sample(head(hidden))
            st.tok[:b], st.pos[:b] = tok, st.pos[:b] + 1
            sampled.append((tok, logp))
        self.engine.stats["steps"] += len(sampled)
        self.timer.mark(b, len(sampled))
        tokens = torch.stack([t for t, _ in sampled], 1).cpu()
        logprobs = torch.stack([p for _, p in sampled], 1).cpu()
        self.scheduler.decoded(chunk, tokens, logprobs)


def padded(rows: list[list[int]]) -> torch.Tensor:
    """Token rows left-aligned in one [len(rows), longest] tensor, zeros after each row."""
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for j, row in enumerate(rows):
        ids[j, :len(row)] = torch.tensor(row)
    return ids
