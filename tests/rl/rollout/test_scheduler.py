"""rl.rollout.scheduler without a model: on 200 seeded random workloads (prompt lengths, max_new_tokens, cache rows,
check_every, slot and prefill budgets, stop ids, tools, samples per prompt, shared prefills), the engine's own loop
(`engine.loop`) over a fake device gives every sequence exactly what a naive reference gives it alone (a fake model's
tokens, cut at its first stop id or `max_new_tokens`, tool outputs appended at each call), and the scheduler keeps its
invariants at every chunk: a cache row serves at most one sequence, batch buckets are buckets
(`scheduler.batch_bucket`: powers of two, or with 3/4 steps) covering the live rows, each step reads past its longest
live row, each live row's cache holds exactly its sequence's tokens (compaction moved them), and each prefill group
stays under the budget (counting distinct prompts with a shared prefill)."""
import random

import torch

from mfsdp_kit.rl.rollout.engine import loop
from mfsdp_kit.rl.rollout.scheduler import batch_bucket, bucketed, first_copies, prefill_groups
from mfsdp_kit.rl.rollout.scheduler import Scheduler
from mfsdp_kit.rl.rollout.timing import CallTimer
from mfsdp_kit.rl.rollout.tools import Tool, ToolConfig

CASES = 200


class CharTokenizer:
    """One character per token (chr(256 + t)): a tool's stop is one token, as find_call sees it in decoded text."""

    def decode(self, ids):
        return "".join(chr(256 + t) for t in ids)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) - 256 for c in text]}


def fake_model(seed: int, vocab: int):
    """The next token after a sequence: a hash of its seed and its whole content (any wrong cache row shows)."""
    return lambda prefix: hash((seed, tuple(prefix))) % vocab


def logprob(token: int) -> float:
    return -(token + 1) / 64


class FakeRunner:
    """`ModelRunner`'s launches on lists: a KV row is the list of tokens written into it, a step writes each row's
    token at its position and samples the fake model over the row; checks the scheduler's invariants per chunk."""

    def __init__(self, scheduler, model, rows, slots):
        self.scheduler, self.model, self.slots = scheduler, model, slots
        self.kv = [[None] * slots for _ in range(rows)]
        self.tok, self.pos = [0] * rows, [0] * rows

    def sample(self, row, n):
        return self.model(self.kv[row][:n])

    def prefill(self, group, sample):
        s = self.scheduler   # the group's cost (distinct prompts with a shared prefill, else rows) x its longest
        cost = len({tuple(q.prompt) for q in group}) if s.share_prefill else len(group)
        assert cost * max(len(q.prompt) for q in group) <= s.prefill_tokens or cost == 1
        toks = []
        for s in group:
            self.kv[s.row][:len(s.prompt)] = s.prompt
            self.pos[s.row], self.tok[s.row] = len(s.prompt), self.sample(s.row, len(s.prompt))
            toks.append(self.tok[s.row])
        return as_tensors([[t] for t in toks])

    def extend(self, items, sample):
        toks = []
        for s, ids, start in items:
            self.kv[s.row][start:start + len(ids)] = ids
            self.pos[s.row], self.tok[s.row] = start + len(ids), self.sample(s.row, start + len(ids))
            toks.append(self.tok[s.row])
        return as_tensors([[t] for t in toks])

    def move(self, move):
        rows = move.rows   # only the first `move.slots` slots go: any a row still reads past them would show
        self.kv[:len(rows)] = [self.kv[r][:move.slots] + [None] * (self.slots - move.slots) for r in rows]
        self.tok[:len(rows)], self.pos[:len(rows)] = [self.tok[r] for r in rows], [self.pos[r] for r in rows]

    def decode(self, chunk, sample):
        self.check(chunk)
        b, out = chunk.batch, [[] for _ in range(chunk.batch)]
        for r in chunk.idle:
            self.pos[r] = 0
        for slots in chunk.slots:
            live = [s for s in self.scheduler.cache[:b] if s is not None and s.waiting is None]
            assert all(self.pos[s.row] < slots <= self.slots for s in live)   # the step reads the row's position
            for r in range(b):
                self.kv[r][self.pos[r]] = self.tok[r]
                self.tok[r] = self.sample(r, self.pos[r] + 1)
                self.pos[r] += 1
                out[r].append(self.tok[r])
        return as_tensors(out)

    def check(self, chunk):
        s, b = self.scheduler, chunk.batch
        held = [q for q in s.cache if q is not None]
        assert len({id(q) for q in held}) == len(held) and all(s.cache[q.row] is q for q in held)
        assert b == len(s.cache) or b == batch_bucket(b, rows=len(s.cache), least=s.min_batch,
                                                      per_doubling=s.per_doubling)
        assert all(q.row < b for q in held) and chunk.idle == [r for r in range(b) if s.cache[r] is None]
        for q in held:
            if q.waiting is None:   # its cache row holds prompt + tokens up to its last, which is the row's next
                seq = q.prompt + q.tokens
                assert self.kv[q.row][:q.length] == seq[:q.length] and len(seq) == q.length + 1
                assert self.tok[q.row] == seq[-1] and self.pos[q.row] == q.length


def as_tensors(tokens):
    t = torch.tensor(tokens, dtype=torch.long)
    return t, torch.tensor([[logprob(x) for x in row] for row in tokens], dtype=torch.float32)


def naive(prompt, *, model, stops, max_new, tools, tok):
    """One sequence alone: the model's tokens one at a time, each tool's output appended at its stop."""
    tokens, mask, calls, turn = [], [], 0, 0
    while len(tokens) < max_new:
        t = model(prompt + tokens)
        tokens.append(t)
        mask.append(1)
        if t in stops:
            break
        tool = next((x for x in tools.tools if x.stop == tok.decode([t])), None) if tools else None
        if tool is None:
            continue
        if calls == tools.max_calls or len(tokens) >= max_new:
            break
        calls += 1
        out = tok(tool.output(tool.call_text(tok.decode(tokens[turn:-1]))))["input_ids"][:tool.max_output_tokens]
        out = out[:max_new - len(tokens)]
        tokens, mask, turn = tokens + out, mask + [0] * len(out), len(tokens) + len(out)
    return tokens, mask


def workload(case: int):
    rng = random.Random(case)
    vocab = rng.randint(6, 40)
    stops = set(rng.sample(range(vocab), rng.randint(0, 2)))
    tools = None
    if rng.random() < 0.5:
        marks = [t for t in range(vocab) if t not in stops][:rng.randint(1, 2)]
        out = rng.randint(1, 5)
        tools = ToolConfig(tools=[Tool(name=f"t{m}", stop=chr(256 + m), fn=lambda call, m=m: chr(256 + (len(call) + m) %
                                       vocab) * 3, max_output_tokens=out) for m in marks],
                           max_calls=rng.randint(1, 3), workers=rng.choice([0, 0, 0, 1]))
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 8))] for _ in range(rng.randint(1, 12))]
    w = dict(vocab=vocab, stops=stops, tools=tools, prompts=prompts, rows=rng.randint(2, 6),
             max_new=rng.randint(1, 20), check_every=rng.randint(1, 6), slot_bucket=rng.randint(1, 8),
             prefill_tokens=rng.randint(1, 30), per_doubling=rng.choice([1, 2]))
    samples = rng.choice([1, 2, 4])   # GRPO's layout: each prompt's samples side by side (drawn last: the rest stays)
    w.update(prompts=[p for p in prompts for _ in range(samples)], share_prefill=rng.random() < 0.7)
    return w


def test_random_workloads_equal_each_sequence_alone():
    kinds = dict(paused=0, compacted=0, queued=0)
    for case in range(CASES):
        w = workload(case)
        model, tok = fake_model(case, w["vocab"]), CharTokenizer()
        longest = max(map(len, w["prompts"]))
        slots = bucketed(longest + w["max_new"] + w["check_every"], w["slot_bucket"])
        scheduler = Scheduler(w["prompts"], rows=w["rows"], slots=slots, max_new_tokens=w["max_new"], stops=w["stops"],
                              check_every=w["check_every"], slot_bucket=w["slot_bucket"],
                              prefill_tokens=w["prefill_tokens"], buckets_per_doubling=w["per_doubling"],
                              tools=w["tools"], tokenizer=tok, share_prefill=w["share_prefill"])
        runner = FakeRunner(scheduler, model, w["rows"], slots)
        moves = []
        runner.move = lambda m, move=runner.move: (moves.append(m), move(m))
        tokens, logprobs, mask = loop(scheduler, runner, None, CallTimer(torch.device("cpu"), {}))
        for i, p in enumerate(w["prompts"]):
            want_tokens, want_mask = naive(p, model=model, stops=w["stops"], max_new=w["max_new"], tools=w["tools"],
                                           tok=tok)
            assert (tokens[i], mask[i]) == (want_tokens, want_mask), (case, i)
            assert logprobs[i] == [logprob(t) for t, m in zip(tokens[i], mask[i]) if m], (case, i)
        assert all(s.done and s.row < 0 for s in scheduler.seqs) and not scheduler.busy()
        kinds["paused"] += sum(m.count(0) > 0 for m in mask)
        kinds["compacted"] += any(m is not None for m in moves)
        kinds["queued"] += len(w["prompts"]) > w["rows"]
    assert min(kinds.values()) >= 20, kinds   # every path ran in many cases


def test_a_call_ended_by_enough_groups_continues_to_each_sequence_alone():
    """Partial rollouts on 100 workloads without tools: each row has its own budget and a group; the call ends at the
    first check point where `enough_groups` groups have every row ended (never earlier: fewer were complete at the
    check point before); a second call given the unfinished rows as prompt + tokens so far, with what is left of
    their budgets, ends every row where the sequence alone ends (the fake model reads the whole prefix, as a
    re-prefill does)."""
    stopped = 0
    for case in range(100):
        w = workload(case)
        rng = random.Random(1000 + case)
        model, tok, n = fake_model(case, w["vocab"]), CharTokenizer(), len(w["prompts"])
        budgets = [rng.randint(1, 20) for _ in range(n)]
        groups = [i // rng.randint(1, 3) for i in range(n)]
        enough = rng.randint(1, len(set(groups)))
        slots = bucketed(max(len(p) + b for p, b in zip(w["prompts"], budgets)) + w["check_every"], w["slot_bucket"])
        complete_at_checks = []
        first = Scheduler(w["prompts"], rows=w["rows"], slots=slots, max_new_tokens=budgets, stops=w["stops"],
                          check_every=w["check_every"], slot_bucket=w["slot_bucket"],
                          prefill_tokens=w["prefill_tokens"], groups=groups, enough_groups=enough)
        runner = FakeRunner(first, model, w["rows"], slots)
        runner.decode = lambda c, s, d=runner.decode: (complete_at_checks.append(first.complete), d(c, s))[1]
        tokens, logprobs, _ = loop(first, runner, None, CallTimer(torch.device("cpu"), {}))
        ended = [s.done for s in first.seqs]
        complete = sum(all(ended[i] for i in range(n) if groups[i] == g) for g in set(groups))
        assert complete >= enough or all(ended), case
        assert all(c < enough for c in complete_at_checks), case   # no check point passed with enough complete
        todo = [i for i in range(n) if not ended[i]]
        stopped += bool(todo)
        if todo:
            rest = Scheduler([w["prompts"][i] + tokens[i] for i in todo], rows=w["rows"], slots=slots + 20,
                             max_new_tokens=[budgets[i] - len(tokens[i]) for i in todo], stops=w["stops"],
                             check_every=w["check_every"], slot_bucket=w["slot_bucket"],
                             prefill_tokens=w["prefill_tokens"])
            more, more_lp, _ = loop(rest, FakeRunner(rest, model, w["rows"], slots + 20), None,
                                    CallTimer(torch.device("cpu"), {}))
            for j, i in enumerate(todo):
                tokens[i], logprobs[i] = tokens[i] + more[j], logprobs[i] + more_lp[j]
        for i, p in enumerate(w["prompts"]):
            want, _ = naive(p, model=model, stops=w["stops"], max_new=budgets[i], tools=None, tok=tok)
            assert tokens[i] == want and logprobs[i] == [logprob(t) for t in want], (case, i)
    assert stopped >= 20, stopped   # many calls did end early


def test_prefill_groups_count_each_distinct_prompt_once():
    """With `first_copies` (a shared prefill), a group costs its distinct prompts x its longest: 8 samples of a
    1,024-token prompt are one group at a budget of 1,024 tokens (8 groups without); copies sit with their first
    (apart in the input or not) and join it past the budget; every index is in one group."""
    assert first_copies([[1, 2], [3], [1, 2], [3], [4]]) == [0, 1, 0, 1, 4]
    assert prefill_groups([1024] * 8, budget_tokens=1024, firsts=[0] * 8) == [list(range(8))]
    assert prefill_groups([1024] * 8, budget_tokens=1024) == [[i] for i in range(8)]
    lengths, firsts = [5, 3, 5, 3, 11, 5, 11], [0, 1, 0, 1, 4, 0, 4]   # 11 > the budget: one prompt, two rows
    groups = prefill_groups(lengths, budget_tokens=10, firsts=firsts)
    assert groups == [[1, 3, 0, 2, 5], [4, 6]]
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
