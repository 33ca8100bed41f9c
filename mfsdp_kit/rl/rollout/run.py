"""One `ContinuousRollout.generate` call's host bookkeeping: which input row each cache row serves, what each row has
sampled, and (with tools) which rows wait on a tool.

A row's life: admitted (its prompt prefilled into a free cache row), decoded `check_every` steps at a time, cut on
the host at its first stop id or at `max_new_tokens`, its cache row then refilled from the queue. With tools
(`tools.ToolConfig`), a row whose new tokens end a call (a tool's stop string, found in the decoded text of its
current turn at the check point) is cut right after the stop and paused: it takes no part in the decode steps while
its tool runs (inline, or on `workers` threads). At the next check point every paused row resumes in one batched
`decoder.extend`: the row's last token (its KV may not be written yet) and the tool's output tokens go into the
row's own cache slots after its completion so far, and the next token is sampled from the last one. The naive loop (a new prompt per turn) would prefill the prompt and every earlier turn again each time.
Resuming at the next check point, whatever the tool's speed, keeps the samples a function of the seed alone (ranks
of one replica must draw the same tokens); rows wait on their tool for `stats["tool_wait_s"]`.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .decoder import extend, prefill
from .sampling import pick
from .schedule import batch_bucket, bucketed, prefill_groups
from .timing import ChunkTimer
from .tools import ToolConfig, find_call


class Run:
    """The rows of one call (module docstring). `loop()` returns per input row (tokens, log-probs of the model's
    tokens, model mask: 1 per model token, 0 per tool token)."""

    def __init__(self, engine, state, rows: list[list[int]], *, max_new_tokens: int, stops: set[int], sample: dict,
                 tools: ToolConfig | None = None):
        self.engine, self.state, self.rows = engine, state, rows
        self.max_new, self.stops, self.sample = max_new_tokens, stops, sample
        self.tools = tools if tools is not None and tools.tools else None
        n_rows = state.shape[0]
        self.owner = [-1] * n_rows          # input row served by each cache row (-1: free)
        self.length = [0] * n_rows          # tokens in each cache row = the slot its next token goes to
        self.queue = deque(range(len(rows)))
        self.tokens: list[list[int]] = [[] for _ in rows]
        self.logprobs: list[list[float]] = [[] for _ in rows]
        self.mask: list[list[int]] = [[] for _ in rows]
        self.turn = [0] * len(rows)          # where each row's current turn (its text since a tool output) starts
        self.calls = [0] * len(rows)
        self.paused: dict[int, tuple] = {}   # cache row -> (tool, future of its output text, paused at)
        self.pool = ThreadPoolExecutor(self.tools.workers) if self.tools and self.tools.workers else None
        self.batch = batch_bucket(min(len(rows), n_rows), rows=n_rows)
        self.timer = ChunkTimer(state.tok.device)
        if self.tools:
            engine.stats.update(tool_calls=0, tool_tokens=0, tool_s=0.0, tool_wait_s=0.0, extend_s=0.0)

    def loop(self) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        try:
            while self.queue or self.live() or self.paused:
                self.resume()
                self.admit()
                self.compact()
                if self.live():
                    self.chunk()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)
        return self.tokens, self.logprobs, self.mask

    def live(self) -> list[int]:
        return [r for r, i in enumerate(self.owner) if i >= 0 and r not in self.paused]

    def admit(self) -> None:
        """Prefill queued prompts into the free rows (left-aligned from slot 0) and record their first token, in
        groups of similar length under the prefill token budget (`prefill_groups`)."""
        free = [r for r, i in enumerate(self.owner) if i < 0][:len(self.queue)]
        if not free:
            return
        take = [self.queue.popleft() for _ in free]
        lengths = [len(self.rows[i]) for i in take]
        for group in prefill_groups(lengths, budget_tokens=self.engine.config.prefill_tokens):
            self.prefill([free[j] for j in group], [take[j] for j in group])
        self.batch = max(self.batch, batch_bucket(max(free) + 1, rows=len(self.owner)))

    def prefill(self, rows: list[int], inputs: list[int]) -> None:
        """One padded prefill of input rows `inputs` into cache rows `rows`; their first tokens sampled."""
        device, e = self.state.tok.device, self.engine
        lengths = [len(self.rows[i]) for i in inputs]
        ids = padded([self.rows[i] for i in inputs])
        where, lens = torch.tensor(rows, device=device), torch.tensor(lengths, device=device)
        t0 = time.perf_counter()
        logits = prefill(e.model, ids.to(device), lens, self.state.kv, where, self.state.rope, head_dim=e.head_dim,
                         clip_qkv=e.clip_qkv, windows=e.windows)
        tok, logp = pick(logits, **self.sample)
        self.state.tok[where], self.state.pos[where] = tok, lens
        for r, i, n in zip(rows, inputs, lengths):
            self.owner[r], self.length[r] = i, n
        self.record(rows, tok[:, None].cpu(), logp[:, None].cpu())
        e.stats["prefill_s"] += time.perf_counter() - t0

    def compact(self) -> None:
        """With the queue empty and at most half the batch live, move the live rows to the front and shrink the
        batch to their bucket (one copy of their cache rows). Never runs with a row paused (`resume` came first)."""
        live = self.live()
        if self.queue or not live or len(live) > self.batch // 2:
            return
        if live != list(range(len(live))):
            src = torch.tensor(live, device=self.state.tok.device)
            for k, v in self.state.kv:
                k[:len(live)], v[:len(live)] = k[src], v[src]
            self.state.tok[:len(live)], self.state.pos[:len(live)] = self.state.tok[src], self.state.pos[src]
            moved = [(self.owner[r], self.length[r]) for r in live]
            self.owner = [i for i, _ in moved] + [-1] * (len(self.owner) - len(live))
            self.length = [n for _, n in moved] + [0] * (len(self.length) - len(live))
        self.batch = batch_bucket(len(live), rows=len(self.owner))

    def chunk(self) -> None:
        """Up to `check_every` decode steps of the batch, then one read of what they sampled."""
        cfg, st, b = self.engine.config, self.state, self.batch
        idle = [r for r in range(b) if self.owner[r] < 0]
        if idle:   # a free row in the batch decodes junk at slot 0 of its own row until it is refilled
            st.pos[torch.tensor(idle, device=st.pos.device)] = 0
        live = [r for r in range(b) if self.owner[r] >= 0]
        top = max(self.length[r] for r in live)
        left = max(self.max_new - len(self.tokens[self.owner[r]]) for r in live)
        slots = st.shape[1]
        sampled, head = [], self.engine.model.lm_head
        for k in range(min(cfg.check_every, left)):
            hidden = self.engine.step(st, b, min(slots, bucketed(top + k + 1, cfg.slot_bucket)))()
            tok, logp = pick(head(hidden), **self.sample)
            st.tok[:b], st.pos[:b] = tok, st.pos[:b] + 1
            sampled.append((tok, logp))
        self.engine.stats["steps"] += len(sampled)
        self.timer.mark(b, len(sampled))
        tokens = torch.stack([t for t, _ in sampled], 1).cpu()
        logprobs = torch.stack([p for _, p in sampled], 1).cpu()
        for r in live:
            self.length[r] += len(sampled)
        self.record(list(range(b)), tokens, logprobs)

    def record(self, cache_rows: list[int], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Append each live row's new tokens [len(cache_rows), k] up to its first stop id or `max_new_tokens`;
        a row that ends frees its cache row, a row that ends a tool call pauses (`pause`). The first stop of every
        row is found at once (no loop over tokens)."""
        k = tokens.shape[1]
        stop = torch.isin(tokens, torch.tensor(sorted(self.stops), dtype=tokens.dtype))
        first = torch.where(stop.any(1), stop.int().argmax(1) + 1, k + 1).tolist()   # tokens kept up to the stop
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        for j, r in enumerate(cache_rows):
            i = self.owner[r]
            if i < 0:
                continue
            room = self.max_new - len(self.tokens[i])
            keep = min(first[j], k, room)
            self.tokens[i] += tokens[j][:keep]
            self.logprobs[i] += logprobs[j][:keep]
            self.mask[i] += [1] * keep
            if self.tools and self.pause(r, i, keep):
                continue
            if first[j] <= k or room <= k:
                self.owner[r] = -1

    # ---- tools ----------------------------------------------------------------------------------
    def pause(self, r: int, i: int, new: int) -> bool:
        """If input row i's last `new` tokens end a tool call: cut it after the stop and start the tool (True), or end
        the row when it has made `max_calls` calls or has no room left (True); else False."""
        found = find_call(self.engine.tokenizer, self.tokens[i], turn_start=self.turn[i], new=new,
                          tools=self.tools.tools)
        if found is None:
            return False
        n, tool = found
        del self.tokens[i][n:], self.mask[i][n:]
        del self.logprobs[i][sum(self.mask[i]):]
        if self.calls[i] >= self.tools.max_calls or len(self.tokens[i]) >= self.max_new:
            self.owner[r] = -1   # the turn limit (or the length limit): the row ends at this call
            return True
        self.calls[i] += 1
        call = tool.call_text(self.engine.tokenizer.decode(self.tokens[i][self.turn[i]:n]).rpartition(tool.stop)[0])
        since = time.perf_counter()
        if self.pool is not None:
            future = self.pool.submit(timed, tool, call)
        else:   # inline: the tool has returned before the next row is looked at
            future = Future()
            future.set_result(timed(tool, call))
        self.paused[r] = (tool, future, since)
        return True

    def resume(self) -> None:
        """Wait for every paused row's tool, append its output (cut to the tool's `max_output_tokens` and the room
        left) as tool tokens, and prefill [last token] + output into the rows' cache in one `decoder.extend`; a row
        left without room ends."""
        if not self.paused:
            return
        e, st = self.engine, self.state
        rows, ids, starts = [], [], []
        for r, (tool, future, since) in sorted(self.paused.items()):
            text, seconds = future.result()
            i = self.owner[r]
            out = e.tokenizer(text, add_special_tokens=False)["input_ids"][:tool.max_output_tokens]
            out = out[:self.max_new - len(self.tokens[i])]
            start = len(self.rows[i]) + len(self.tokens[i]) - 1   # the slot of the row's last token
            ids.append([self.tokens[i][-1]] + out)
            self.tokens[i] += out
            self.mask[i] += [0] * len(out)
            self.turn[i] = len(self.tokens[i])
            e.stats["tool_calls"] += 1
            e.stats["tool_tokens"] += len(out)
            e.stats["tool_s"] += seconds
            e.stats["tool_wait_s"] += time.perf_counter() - since
            if len(self.tokens[i]) >= self.max_new:
                self.owner[r] = -1
                ids.pop()
                continue
            rows.append(r)
            starts.append(start)
        self.paused.clear()
        if rows:
            t0 = time.perf_counter()
            device = st.tok.device
            lengths = torch.tensor([len(x) for x in ids], device=device)
            where, first = torch.tensor(rows, device=device), torch.tensor(starts, device=device)
            logits = extend(e.model, padded(ids).to(device), first, lengths, st.kv, where, st.rope,
                            head_dim=e.head_dim, clip_qkv=e.clip_qkv, windows=e.windows)
            tok, logp = pick(logits, **self.sample)
            st.tok[where], st.pos[where] = tok, first + lengths
            for r, n in zip(rows, (first + lengths).tolist()):
                self.length[r] = n
            self.batch = max(self.batch, batch_bucket(max(rows) + 1, rows=len(self.owner)))
            self.record(rows, tok[:, None].cpu(), logp[:, None].cpu())
            e.stats["extend_s"] += time.perf_counter() - t0


def timed(tool, call: str) -> tuple[str, float]:
    """(the tool's output text, seconds it took): what a worker thread returns."""
    t0 = time.perf_counter()
    return tool.output(call), time.perf_counter() - t0


def padded(rows: list[list[int]]) -> torch.Tensor:
    """Token rows left-aligned in one [len(rows), longest] tensor, zeros after each row."""
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for j, row in enumerate(rows):
        ids[j, :len(row)] = torch.tensor(row)
    return ids
