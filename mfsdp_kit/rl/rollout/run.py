"""One `ContinuousRollout.generate` call's device work: the launches that carry out `scheduler.Scheduler`'s decisions
over the engine's cache (`runner.Cache`). The scheduler decides on the host which sequences are admitted,
which rows move, how many steps the next chunk runs and where each sequence stops; `Run` prefills, extends (a tool's
output into a paused sequence's own cache slots), copies cache rows, writes the rows' next token and position, and
replays the decode steps (`runner.Runner.step`: a CUDA graph per batch and slot bucket on a GPU, all captured when
the cache was made). `Run.loop` is the whole call: the two joined, one check point per turn of the loop.

`ahead` (`DecodeConfig.overlap`, calls without tools): each chunk is launched before the previous one's tokens are
read, so the device runs chunk k while the host reads chunk k-1, cuts its rows and decides chunk k+1 (SGLang's
overlap scheduler). The decisions lag one chunk: a row that stopped in chunk k-1 decodes junk through chunk k (cut
on the host as any step past a stop is), and a compaction or a refill waits one check point longer.
"""
from __future__ import annotations

import time

import torch

from .decoder import extend, prefill
from .sampling import pick
from .scheduler import Chunk, Scheduler, Sequence
from .timing import ChunkTimer


class Run:
    """The device side of one call (module docstring); `loop()` returns the scheduler's `results()`."""

    def __init__(self, engine, state, scheduler: Scheduler, *, sample: dict, ahead: bool = False):
        self.engine, self.state, self.scheduler, self.sample, self.ahead = engine, state, scheduler, sample, ahead
        self.timer = ChunkTimer(state.tok.device)

    def loop(self) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        """Per check point: resume the sequences back from their tools, admit queued ones, compact, launch a chunk,
        read one (the one just launched, or with `ahead` the one before it)."""
        s, unread = self.scheduler, None
        try:
            while s.busy():
                self.extend(s.resume())
                for group in s.admit():
                    self.prefill(group)
                self.move(s.compact())
                chunk = s.next_chunk()
                launched = None if chunk is None else self.launch(chunk)
                if unread is not None:
                    self.read(unread)
                unread = launched
                if not self.ahead and unread is not None:
                    self.read(unread)
                    unread = None
            if unread is not None:   # steps launched before the last read ended every sequence
                self.read(unread)
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
        tok, logp = pick(logits, **self.sample)
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
        tok, logp = pick(logits, **self.sample)
        st.tok[where], st.pos[where] = tok, first + lengths
        self.scheduler.record(seqs, tok[:, None].cpu(), logp[:, None].cpu())
        e.stats["extend_s"] += time.perf_counter() - t0

    def move(self, rows: list[int] | None) -> None:
        """Cache rows `rows` (KV, next token, position) copied to rows 0..len(rows)-1 (`Scheduler.compact`)."""
        if rows is None:
            return
        st, n = self.state, len(rows)
        src = torch.tensor(rows, device=st.tok.device)
        for k, v in st.kv:
            k[:n], v[:n] = k[src], v[src]
        st.tok[:n], st.pos[:n] = st.tok[src], st.pos[src]

    def launch(self, chunk: Chunk) -> Launched:
        """The chunk's decode steps, and the copies of what they sample to host memory, queued on the device."""
        st, b = self.state, chunk.batch
        if chunk.idle:   # a free row in the batch decodes junk at slot 0 of its own row until it is refilled
            st.pos[torch.tensor(chunk.idle, device=st.pos.device)] = 0
        sampled, head = [], self.engine.model.lm_head
        for slots in chunk.slots:
            hidden = self.engine.runner.step(b, slots)()
            tok, logp = pick(head(hidden), **self.sample)
            st.tok[:b], st.pos[:b] = tok, st.pos[:b] + 1
            sampled.append((tok, logp))
        self.scheduler.launched(chunk)
        self.engine.stats["steps"] += len(sampled)
        self.timer.mark(b, len(sampled))
        return Launched(chunk, torch.stack([t for t, _ in sampled], 1), torch.stack([p for _, p in sampled], 1))

    def read(self, launched: Launched) -> None:
        """Wait for a launched chunk's tokens on the host (the loop's only sync) and hand them to the scheduler."""
        self.scheduler.decoded(launched.chunk, *launched.wait())


class Launched:
    """A chunk on the device: its tokens and log-probs [batch, steps] on their way to host memory (pinned buffers,
    copied without a sync: `wait` blocks on an event after the copies, not on the whole device)."""

    def __init__(self, chunk: Chunk, tokens: torch.Tensor, logprobs: torch.Tensor):
        self.chunk, self.event = chunk, None
        if tokens.device.type != "cuda":
            self.tokens, self.logprobs = tokens, logprobs
            return
        self.tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True).copy_(tokens, non_blocking=True)
        self.logprobs = torch.empty(logprobs.shape, dtype=logprobs.dtype,
                                    pin_memory=True).copy_(logprobs, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.tokens, self.logprobs


def padded(rows: list[list[int]]) -> torch.Tensor:
    """Token rows left-aligned in one [len(rows), longest] tensor, zeros after each row."""
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for j, row in enumerate(rows):
        ids[j, :len(row)] = torch.tensor(row)
    return ids
