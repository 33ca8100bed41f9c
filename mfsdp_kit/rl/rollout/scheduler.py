"""The rollout engine's scheduler (nano-vllm's `Scheduler`): one `ContinuousRollout.generate` call's policy, on the host
alone: which sequence each cache row serves, which rows the next decode steps run and which slots they read, which
prompts one prefill takes, what each sequence has sampled, where it stops, and (with tools) which sequences wait on a
tool. It imports no model code and launches nothing, so the policy is tested without a model
(tests/rl/rollout/test_scheduler.py, against a naive reference); `model_runner.ModelRunner` carries its decisions out
on the device, and `engine.step` joins the two, one check point at a time.

A sequence's life: admitted (its prompt prefilled into a free cache row, `admit`), decoded `check_every` steps at a
time (`next_chunk`), cut at its first stop id or at `max_new_tokens` (`record`), its cache row then refilled from the
queue. Once the queue is empty and the live rows fit a smaller batch bucket, they move to the front and the batch
shrinks to their bucket (`compact`). With tools (`tools.ToolConfig`), a sequence whose new tokens end a call (a
tool's stop string, found in the decoded text of its current turn at the check point) is cut right after the stop
and paused: it takes no part in the decode steps while its tool runs (inline, or on `workers` threads). At the next
check point every paused sequence resumes (`resume`): its last token (its KV may not be written yet) and the tool's
output tokens go into its own cache slots after its completion so far (one batched `decoder.extend` in the runner),
and the next token is sampled from the last one. The naive loop (a new prompt per turn) would prefill the prompt and
every earlier turn again each time. Resuming at the next check point, whatever the tool's speed, keeps the samples a
function of the seed alone (ranks of one replica must draw the same tokens); sequences wait on their tool for
`stats["tool_wait_s"]`.

Partial rollouts (`rl.partial`): each sequence has its own `budget` of new tokens (a row continued from an earlier
call comes as prompt + its tokens so far, with what is left of its budget), and with `groups` (a group id per row) and
`enough_groups` the call ends at the first check point where that many groups have every row ended; the rows still
running keep what they sampled (`Sequence.done` False) and are continued by a later call.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .tools import ToolConfig, find_call


def bucketed(n: int, bucket: int) -> int:
    """`n` rounded up to a multiple of `bucket`."""
    return -(-n // bucket) * bucket


def batch_bucket(n: int, *, rows: int, least: int = 2, per_doubling: int = 2) -> int:
    """The decode batch for `n` live rows: the smallest bucket >= n, at least `least` (`DecodeConfig.min_batch`) and 2
    (a batch of 1 would compile glue of its own), at most `rows`. Buckets are the powers of two, and with
    `per_doubling` 2 (`DecodeConfig.buckets_per_doubling`) also 3/4 of each (..., 48, 64, 96, 128, 192, 256, 384,
    512): a bucket then idles at most a third of its rows, not half."""
    n = max(n, least, 2)
    bucket = 1 << (n - 1).bit_length()
    if per_doubling == 2 and bucket >= 4 and bucket * 3 // 4 >= n:
        bucket = bucket * 3 // 4
    return min(rows, bucket)


def first_copies(prompts: list[list[int]]) -> list[int]:
    """For each prompt, the index of the first prompt equal to it (its own where it is the first): a shared prefill
    (`DecodeConfig.share_prefill`) runs the prompts i with first[i] == i, and every other row takes its first's KV."""
    seen: dict[tuple[int, ...], int] = {}
    return [seen.setdefault(tuple(p), i) for i, p in enumerate(prompts)]


def prefill_groups(lengths: list[int], *, budget_tokens: int, firsts: list[int] | None = None) -> list[list[int]]:
    """Indices of `lengths` (prompt tokens) in prefill groups: shortest first, each group's padded batch
    (its rows x its longest prompt) at most `budget_tokens`; a prompt longer than the budget is a group alone.
    Sorting keeps the padding small: the naive batch of every free row pads all of them to the longest prompt.
    With `firsts` (`first_copies`: a shared prefill) equal prompts sit together and a group costs its distinct
    prompts only, so GRPO's n samples of a prompt are one prefill of its tokens, however long."""
    firsts = list(range(len(lengths))) if firsts is None else firsts
    groups: list[list[int]] = []
    distinct: set[int] = set()   # the last group's first copies
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], firsts[i], i)):
        if groups and (firsts[i] in distinct or (len(distinct) + 1) * lengths[i] <= budget_tokens):
            groups[-1].append(i)
        else:
            groups.append([i])
            distinct = set()
        distinct.add(firsts[i])
    return groups


@dataclass(kw_only=True, eq=False)
class Sequence:
    """One input row of the call: its prompt and what it has become. One object per row (not parallel lists), so a
    move to another cache row (`Scheduler.compact`) carries all its state at once."""

    index: int
    """Its place in the call's input (and output) rows."""
    prompt: list[int]
    budget: int = 0
    """New tokens it may add in this call (`max_new_tokens`, or its own with partial rollouts)."""
    tokens: list[int] = field(default_factory=list)
    """The completion: the model's tokens and the tools' outputs."""
    logprobs: list[float] = field(default_factory=list)
    """Log-probs of the model's tokens only."""
    mask: list[int] = field(default_factory=list)
    """1 per model token, 0 per tool token."""
    turn: int = 0
    """Where its current turn (its text since the last tool output) starts in `tokens`."""
    calls: int = 0
    """Tool calls made."""
    row: int = -1
    """The cache row serving it (-1: queued or done)."""
    length: int = 0
    """Tokens in its cache row = the slot its next token goes to."""
    done: bool = False
    """Ended (stop id, max_new_tokens or the turn limit): its tokens are final."""
    routes: object = None
    """Its MoE routes [prompt + completion tokens, moe_layers, k] when the call records them (`routes.py`)."""
    waiting: tuple | None = None
    """(tool, future of its output text, paused at) while it waits on a tool."""


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """The next decode steps: the first `batch` cache rows, one step per entry of `slots` (the slot bucket it reads);
    the `idle` rows (no sequence) decode junk at slot 0 of their own row until refilled."""

    batch: int
    slots: list[int]
    idle: list[int]


@dataclass(frozen=True, kw_only=True)
class Move:
    """A compaction (`Scheduler.compact`): cache rows `rows` (ascending) copied to rows 0..len(rows)-1, where the
    scheduler has placed their sequences, their first `slots` slots only (no step has read past the longest of them)."""

    rows: list[int]
    slots: int


class Scheduler:
    """The sequences of one call over `rows` cache rows of `slots` slots (module docstring). The engine asks it what to
    launch (`resume`, `admit`, `compact`, `next_chunk`) and hands back what the launches sampled (`record`,
    `decoded`); `results()` gives per input row (tokens, log-probs of the model's tokens, model mask)."""

    def __init__(self, prompts: list[list[int]], *, rows: int, slots: int, max_new_tokens: int | list[int],
                 stops: set[int], check_every: int, slot_bucket: int, prefill_tokens: int, min_batch: int = 2,
                 buckets_per_doubling: int = 2, tools: ToolConfig | None = None, tokenizer=None,
                 stats: dict | None = None, on_finish=None, groups: list[int] | None = None,
                 enough_groups: int | None = None, share_prefill: bool = True):
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        self.seqs = [Sequence(index=i, prompt=list(p), budget=b) for i, (p, b) in enumerate(zip(prompts, budgets))]
        self.queue = deque(self.seqs)
        self.cache: list[Sequence | None] = [None] * rows   # the sequence each cache row serves
        self.slots, self.check_every, self.slot_bucket = slots, check_every, slot_bucket
        self.prefill_tokens, self.min_batch, self.per_doubling = prefill_tokens, min_batch, buckets_per_doubling
        self.share_prefill = share_prefill
        """Prefill groups count each distinct prompt once (the runner prefills it once: `DecodeConfig.share_prefill`)."""
        self.stop_ids = torch.tensor(sorted(stops), dtype=torch.long)
        self.tools = tools if tools is not None and tools.tools else None
        self.tokenizer = tokenizer
        self.stats = stats if stats is not None else {}
        self.on_finish = on_finish
        """Called with a sequence that ends, before its cache row is freed (what the device keeps of it is read)."""
        self.pool = ThreadPoolExecutor(self.tools.workers) if self.tools and self.tools.workers else None
        self.batch = self.bucket(min(len(prompts), rows))
        self.groups, self.enough, self.complete = groups, enough_groups, 0
        """Partial rollouts: a group id per row; end the call once `enough` groups are complete (None: once every
        row has ended); groups complete so far."""
        self.left = Counter(groups if enough_groups is not None else [])   # group id -> its rows not ended yet
        if self.tools:
            self.stats.update(tool_calls=0, tool_tokens=0, tool_s=0.0, tool_wait_s=0.0, extend_s=0.0)

    # ---- what runs next ---------------------------------------------------------------------------
    def bucket(self, live: int) -> int:
        """The batch bucket for `live` rows of this call's cache (`batch_bucket`, at least `min_batch`)."""
        return batch_bucket(live, rows=len(self.cache), least=self.min_batch, per_doubling=self.per_doubling)

    def busy(self) -> bool:
        """Sequences are queued, decoding or waiting on a tool, and `enough_groups` are not complete yet."""
        if self.satisfied():
            return False
        return bool(self.queue) or any(s is not None for s in self.cache)

    def satisfied(self) -> bool:
        """`enough_groups` groups are complete: the call ends (partial rollouts)."""
        return self.enough is not None and self.complete >= self.enough

    def live(self) -> list[int]:
        """Cache rows whose sequence decodes (not waiting on a tool)."""
        return [r for r, s in enumerate(self.cache) if s is not None and s.waiting is None]

    def admit(self) -> list[list[Sequence]]:
        """Queued sequences placed in the free rows (left-aligned from slot 0), in prefill groups of similar length
        under the prefill token budget (`prefill_groups`, counting each distinct prompt once with `share_prefill`);
        the runner prefills each group, and its first tokens come back through `record`."""
        free = [r for r, s in enumerate(self.cache) if s is None][:len(self.queue)]
        if not free:
            return []
        take = [self.queue.popleft() for _ in free]
        for r, s in zip(free, take):
            s.row, s.length, self.cache[r] = r, len(s.prompt), s
        self.batch = max(self.batch, self.bucket(max(free) + 1))
        firsts = first_copies([s.prompt for s in take]) if self.share_prefill else None
        groups = prefill_groups([len(s.prompt) for s in take], budget_tokens=self.prefill_tokens, firsts=firsts)
        return [[take[j] for j in group] for group in groups]

    def compact(self) -> Move | None:
        """With the queue empty, no sequence waiting and the live rows' bucket smaller than the batch: the live rows
        move to the front and the batch shrinks to their bucket. Returns the copy the runner makes (None: nothing
        moves)."""
        live = self.live()
        if self.queue or not live or any(s.waiting for s in self.cache if s):
            return None
        smaller = self.bucket(len(live))
        if smaller >= self.batch:   # no smaller bucket holds them (or the batch is at `min_batch` already)
            return None
        self.batch = smaller
        if live == list(range(len(live))):
            return None
        moved = [self.cache[r] for r in live]
        self.cache = moved + [None] * (len(self.cache) - len(live))
        for r, s in enumerate(moved):
            s.row = r
        return Move(rows=live, slots=max(s.length for s in moved))

    def next_chunk(self) -> Chunk | None:
        """Up to `check_every` decode steps of the batch (fewer when every live sequence has less room left), each
        reading the cache up to the next `slot_bucket` past the longest live row; None when none decodes."""
        b = self.batch
        live = [s for s in self.cache[:b] if s is not None and s.waiting is None]
        if not live or self.satisfied():   # a prefill may have completed the last group needed
            return None
        top = max(s.length for s in live)
        left = max(s.budget - len(s.tokens) for s in live)
        slots = [min(self.slots, bucketed(top + k + 1, self.slot_bucket)) for k in range(min(self.check_every, left))]
        return Chunk(batch=b, slots=slots, idle=[r for r in range(b) if self.cache[r] is None])

    # ---- what was sampled -------------------------------------------------------------------------
    def decoded(self, chunk: Chunk, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """The chunk's sampled tokens and log-probs [batch, steps] (CPU), row by row."""
        rows = self.cache[:chunk.batch]
        for s in rows:
            if s is not None and s.waiting is None:
                s.length += tokens.shape[1]
        self.record(rows, tokens, logprobs)

    def record(self, seqs: list[Sequence | None], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Append each decoding sequence's new tokens [len(seqs), k] up to its first stop id or `max_new_tokens`;
        one that ends frees its cache row, one that ends a tool call pauses (`pause`). The first stop of every row
        is found at once (no loop over tokens)."""
        k = tokens.shape[1]
        stop = torch.isin(tokens, self.stop_ids.to(tokens.dtype))
        first = torch.where(stop.any(1), stop.int().argmax(1) + 1, k + 1).tolist()   # tokens kept up to the stop
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        for j, s in enumerate(seqs):
            if s is None or s.done or s.waiting is not None:
                continue
            room = s.budget - len(s.tokens)
            keep = min(first[j], k, room)
            s.tokens += tokens[j][:keep]
            s.logprobs += logprobs[j][:keep]
            s.mask += [1] * keep
            if self.tools and self.pause(s, keep):
                continue
            if first[j] <= k or room <= k:
                self.finish(s)

    def finish(self, s: Sequence) -> None:
        """The sequence ends; its cache row is free for the queue at the next `admit`."""
        if self.on_finish is not None:
            self.on_finish(s)
        self.cache[s.row], s.row, s.done = None, -1, True
        if self.enough is not None:
            g = self.groups[s.index]
            self.left[g] -= 1
            self.complete += self.left[g] == 0

    def results(self) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        """Per input row, in input order: (tokens, log-probs of the model's tokens, model mask)."""
        return [s.tokens for s in self.seqs], [s.logprobs for s in self.seqs], [s.mask for s in self.seqs]

    def close(self) -> None:
        """Wait for the tool threads (a call that raised still leaves none running)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    # ---- tools ------------------------------------------------------------------------------------
    def pause(self, s: Sequence, new: int) -> bool:
        """If the sequence's last `new` tokens end a tool call: cut it after the stop and start the tool (True), or
        end it when it has made `max_calls` calls or has no room left (True); else False."""
        found = find_call(self.tokenizer, s.tokens, turn_start=s.turn, new=new, tools=self.tools.tools)
        if found is None:
            return False
        n, tool = found
        del s.tokens[n:], s.mask[n:]
        del s.logprobs[sum(s.mask):]
        if s.calls >= self.tools.max_calls or len(s.tokens) >= s.budget:
            self.finish(s)   # the turn limit (or the length limit): the sequence ends at this call
            return True
        s.calls += 1
        call = tool.call_text(self.tokenizer.decode(s.tokens[s.turn:n]).rpartition(tool.stop)[0])
        since = time.perf_counter()
        if self.pool is not None:
            future = self.pool.submit(timed, tool, call)
        else:   # inline: the tool has returned before the next sequence is looked at
            future = Future()
            future.set_result(timed(tool, call))
        s.waiting = (tool, future, since)
        return True

    def resume(self) -> list[tuple[Sequence, list[int], int]]:
        """Wait for every paused sequence's tool and append its output (cut to the tool's `max_output_tokens` and
        the room left) as tool tokens; a sequence left without room ends. Returns, per sequence to extend, (it,
        [last token] + output, the slot of its last token): the runner prefills them in one `decoder.extend`, and the
        tokens sampled after them come back through `record`."""
        out = []
        for s in [s for s in self.cache if s is not None and s.waiting is not None]:
            tool, future, since = s.waiting
            s.waiting = None
            text, seconds = future.result()
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][:tool.max_output_tokens]
            ids = ids[:s.budget - len(s.tokens)]
            start = len(s.prompt) + len(s.tokens) - 1   # the slot of the sequence's last token
            item = (s, [s.tokens[-1]] + ids, start)
            s.tokens += ids
            s.mask += [0] * len(ids)
            s.turn = len(s.tokens)
            self.stats["tool_calls"] += 1
            self.stats["tool_tokens"] += len(ids)
            self.stats["tool_s"] += seconds
            self.stats["tool_wait_s"] += time.perf_counter() - since
            if len(s.tokens) >= s.budget:
                self.finish(s)
                continue
            s.length = start + len(item[1])
            out.append(item)
        if out:
            self.batch = max(self.batch, self.bucket(max(s.row for s, _, _ in out) + 1))
        return out


def timed(tool, call: str) -> tuple[str, float]:
    """(the tool's output text, seconds it took): what a worker thread returns."""
    t0 = time.perf_counter()
    return tool.output(call), time.perf_counter() - t0
