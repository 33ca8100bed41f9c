"""Data without downloads: a synthetic arithmetic task, SFT tokenization, a JSONL loader.

Text is rendered by the tokenizer's own chat template (`mfsdp_kit.train.chat`). An arithmetic example is
a (prompt, response) pair of text: with the tiny tokenizer prompt "<|user|>12+34=<|assistant|>",
response "46</s>"; with a ChatML one "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
and "46<|im_end|>" (the response ends with the end-of-turn token, so the model learns to stop). A
JSONL conversation becomes an `Example`: token ids and which of them are the assistant's (every
assistant turn). `tokenize_sft` turns either into a `Batch`, with the loss only on reply tokens.
"""
from __future__ import annotations

import json
import pathlib
import random
import re
import zlib
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Iterator

import torch

from . import chat
from ..distributed import runtime
from ..config import bad_value, is_int
from ..fieldtypes import COUNT, INDEX, checked_args, number_in, optional
from ..models.tiny import EOS, build_tokenizer

Pair = tuple[str, str]
"""(prompt, response): the prompt rendered by the chat template up to the generation prompt, the
response the reply text ending with the end-of-turn token."""


@dataclass(frozen=True)
class Example:
    """One tokenized conversation (e.g. a JSONL row): its ids and which ones the model must produce."""

    ids: tuple[int, ...]
    """Token ids of the whole rendered conversation."""
    target: tuple[bool, ...]
    """Per token: True on the assistant's tokens (every assistant turn, end-of-turn included)."""


OPS = ("+", "-", "*")
SPLITS = ("train", "heldout")
_PROBLEM_RE = re.compile(r"(\d+)([+\-*])(\d+)=")
_ANSWER_RE = re.compile(r"-?\d+")
_THINK_RE = re.compile(r"\s*<think>.*?</think>", re.DOTALL)
_ENUMERATE_MAX = 200_000
"""Problem spaces up to this size are enumerated and shuffled; larger ones are sampled."""


# ---- what a training step consumes ------------------------------------------------------
@dataclass
class Batch:
    """One global batch: every rank holds the same tensors and takes its data-parallel slice."""

    tokens: torch.Tensor
    """[batch, seq] input token ids."""
    labels: torch.Tensor
    """[batch, seq] next-token targets."""
    loss_mask: torch.Tensor
    """[batch, seq] 1.0 where the token counts in the loss (e.g. the answer), else 0.0."""
    extras: dict = field(default_factory=dict)
    """More per-sequence tensors ([batch, ...]) a custom loss reads, e.g. GRPO's advantages."""

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    def slice(self, start: int, stop: int) -> "Batch":
        return Batch(self.tokens[start:stop], self.labels[start:stop], self.loss_mask[start:stop],
                     {k: v[start:stop] for k, v in self.extras.items()})

    def to(self, device) -> "Batch":
        """The batch on `device` (`runtime.to_device`: to a GPU through pinned memory, without blocking)."""
        move = partial(runtime.to_device, device=device)
        return Batch(move(self.tokens), move(self.labels), move(self.loss_mask), {k: move(v) for k, v in self.extras.items()})


# ---- synthetic arithmetic ------------------------------------------------------------------
def is_heldout(a: int, op: str, b: int) -> bool:
    """A stable hash of the problem mod 10 == 0 (~10%): the same split on every machine/run."""
    return zlib.crc32(f"{a}{op}{b}".encode()) % 10 == 0


def solve(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


@dataclass(kw_only=True)
class ArithmeticTask:
    """"a op b =" problems; train and held-out are disjoint by a hash of (a, op, b)."""

    digits: int = 2
    """Operands are drawn from 0 .. 10**digits - 1."""
    ops: tuple[str, ...] = ("+",)
    """Operators among + - * (difficulty grows with digits and with *)."""
    seed: int = 0
    """Same seed -> same problems in the same order."""
    tokenizer: object = field(default=None, repr=False, compare=False)
    """Whose chat template renders the prompts and replies; None: the tiny model's tokenizer."""

    def __post_init__(self):
        if self.digits < 1:
            raise bad_value("digits", self.digits, "an integer >= 1")
        bad = [op for op in self.ops if op not in OPS]
        if bad or not self.ops:
            raise bad_value("ops", self.ops, f"a non-empty subset of {OPS}")
        self._frame = _checked_frame(self.tokenizer or tiny_tokenizer())

    def prompt(self, a: int, op: str, b: int) -> str:
        """The question "a op b =" as one user turn, rendered up to the generation prompt."""
        before, after, _, _ = self._frame
        return f"{before}{a}{op}{b}={after}"

    def reply(self, answer: str) -> str:
        """The reply text the model must produce: `answer` and the template's end-of-turn."""
        _, _, before, after = self._frame
        return before + answer + after

    def answer(self, a: int, op: str, b: int) -> str:
        """The ground-truth answer text, without eos."""
        return str(solve(a, op, b))

    def problems(self, n: int, *, split: str = "train") -> list[tuple[int, str, int]]:
        """n distinct (a, op, b) of `split`, deterministic by seed; a longer n extends a shorter one."""
        if split not in SPLITS:
            raise bad_value("split", split, " | ".join(SPLITS))
        rng = random.Random(f"{self.seed}-{split}")  # str seeds hash with sha512: stable across runs
        space = len(self.ops) * 10 ** (2 * self.digits)
        if space <= _ENUMERATE_MAX:
            return self._enumerated(n, split, rng)
        return self._sampled(n, split, rng, space)

    def _enumerated(self, n, split, rng) -> list[tuple[int, str, int]]:
        top = 10 ** self.digits
        items = [(a, op, b) for op in self.ops for a in range(top) for b in range(top)
                 if is_heldout(a, op, b) == (split == "heldout")]
        if n > len(items):
            raise ValueError(f"n={n} exceeds the {len(items)} {split} problems of digits={self.digits}, "
                             f"ops={self.ops}; raise digits or add ops")
        rng.shuffle(items)
        return items[:n]

    def _sampled(self, n, split, rng, space) -> list[tuple[int, str, int]]:
        if n > space // 20:
            raise ValueError(f"n={n} is too many distinct problems for sampling from {space}; lower n")
        top, seen, out = 10 ** self.digits, set(), []
        while len(out) < n:
            item = (rng.randrange(top), rng.choice(self.ops), rng.randrange(top))
            if item not in seen and is_heldout(*item) == (split == "heldout"):
                seen.add(item)
                out.append(item)
        return out

    def pairs(self, n: int, *, split: str = "train") -> list[Pair]:
        return [(self.prompt(*p), self.reply(self.answer(*p))) for p in self.problems(n, split=split)]

    def train_pairs(self, n: int) -> list[Pair]:
        return self.pairs(n, split="train")

    def heldout_pairs(self, n: int) -> list[Pair]:
        return self.pairs(n, split="heldout")

    def rl_prompts(self, n: int, *, split: str = "train") -> list[tuple[str, str]]:
        """(prompt, ground-truth answer without end-of-turn) for RL rollouts; score with `verify`."""
        return [(self.prompt(*p), self.answer(*p)) for p in self.problems(n, split=split)]

    def verify(self, prompt: str, completion: str) -> float:
        return verify(prompt, completion)


@lru_cache(maxsize=1)
def tiny_tokenizer():
    """The tiny model's tokenizer (built once per process): the default for `ArithmeticTask`."""
    return build_tokenizer()


def _checked_frame(tokenizer) -> tuple[str, str, str, str]:
    """`chat.reply_frame`, checked against the template's own rendering of one problem."""
    frame = chat.reply_frame(tokenizer)
    question = [{"role": "user", "content": "12+34="}]
    prompt = chat.render(tokenizer, question, add_generation_prompt=True)
    if prompt != f"{frame[0]}12+34={frame[1]}":
        raise chat.ChatTemplateError(f"the chat template of {getattr(tokenizer, 'name_or_path', '')!r} changes "
                                     f"the question text it renders: {prompt!r}")
    return frame


def _truth_and_answer(prompt: str, completion: str) -> tuple[str, str | None]:
    """(true result text, the completion's leading integer or None): the completion is cut at
    the first eos, a leading <think>...</think> block is dropped, the rest stripped; the integer
    is an optional '-' then digits. The problem is the prompt's last "a op b=" (after any
    system text the template adds)."""
    found = _PROBLEM_RE.findall(prompt)
    if not found:
        raise ValueError(f"prompt {prompt!r} is not an arithmetic prompt like '<|user|>12+34=<|assistant|>'")
    a, op, b = found[-1]
    text = completion.split(EOS, 1)[0]
    think = _THINK_RE.match(text)
    got = _ANSWER_RE.match(text[think.end() if think else 0:].strip())
    return str(solve(int(a), op, int(b))), None if got is None else got[0]


def verify(prompt: str, completion: str) -> float:
    """Exact-match reward: 1.0 iff the completion starts with the true result.

    The completion is cut at the first eos (anything after it is ignored), then its leading
    integer (optional '-', digits; ends at the first other character) must equal the answer
    exactly: "46</s>junk" and "46 because" score 1.0, "046" and "4 6" score 0.0."""
    truth, got = _truth_and_answer(prompt, completion)
    return float(got == truth)


def digit_match(prompt: str, completion: str) -> float:
    """Partial-credit reward in [0, 1]: the share of characters right, compared by place value.

    The leading integer is read as in `verify`; the true result and it are right-aligned (units
    under units, so a dropped carry digit costs one character, not all of them), and the count
    of equal characters is divided by the longer length: for 27+19=46, "46" -> 1.0, "45" -> 0.5,
    "146" -> 2/3, "6" -> 1/2, "" or "x" -> 0.0. Only an exact match scores 1.0.

    Why: exact match gives a group of samples the same 0 on most prompts of a weak model, so
    GRPO has nothing to compare; per-digit credit separates "off by one digit" from "nonsense"
    and gives every prompt a gradient towards the right digits."""
    truth, got = _truth_and_answer(prompt, completion)
    if got is None:
        return 0.0
    same = sum(t == g for t, g in zip(reversed(truth), reversed(got)))
    return same / max(len(truth), len(got))


REWARDS = {"exact": verify, "digits": digit_match}
"""Reward functions by name, each `callable(prompt, completion) -> float` in [0, 1]."""


# ---- SFT tokenization ----------------------------------------------------------------------
def _example(item, tokenizer, i: int) -> Example:
    """A Pair (prompt and response encoded separately, so the boundary is exact for any
    tokenizer), a list of messages (rendered by the chat template) or an Example as it is."""
    if isinstance(item, Example):
        return item
    if isinstance(item, list):
        ids, target = chat.encode(tokenizer, item, where=f"example {i}")
        return Example(tuple(ids), tuple(target))
    prompt, response = item
    p, r = chat.encode_text(tokenizer, prompt), chat.encode_text(tokenizer, response)
    if not p or not r:
        raise ValueError(f"pair {i} has an empty prompt or response: {(prompt, response)!r}")
    return Example(tuple(p + r), (False,) * len(p) + (True,) * len(r))


def seq_len_needed(items: list, tokenizer, *, multiple_of: int = 1) -> int:
    """The shortest seq_len_tokens keeping every example whole (its tokens - 1), rounded up to a `multiple_of`."""
    if not (is_int(multiple_of) and multiple_of >= 1):
        raise bad_value("multiple_of", multiple_of, "an integer >= 1")
    return -(-max(len(_example(item, tokenizer, i).ids) - 1 for i, item in enumerate(items)) // multiple_of) * multiple_of


def tokenize_sft(items: list, tokenizer, *, seq_len_tokens: int) -> Batch:
    """Pairs, conversations (lists of messages) or Examples -> Batch[n, seq_len_tokens]:
    tokens = ids[:-1], labels = ids[1:] (next token).

    loss_mask is 1.0 where the TARGET is a reply token (end-of-turn included), 0.0 on prompt,
    template text and padding. Padding is the pad token, else eos (`chat.pad_id`); it is never
    a target. An example longer than seq_len_tokens + 1 tokens would lose reply tokens: ValueError."""
    tokens = torch.full((len(items), seq_len_tokens), chat.pad_id(tokenizer), dtype=torch.long)
    labels, loss_mask = tokens.clone(), torch.zeros(len(items), seq_len_tokens)
    for i, item in enumerate(items):
        ex = _example(item, tokenizer, i)
        n = len(ex.ids) - 1
        if n > seq_len_tokens:
            raise ValueError(f"example {i} has {len(ex.ids)} tokens; seq_len_tokens={seq_len_tokens} would "
                             f"cut its answer; use seq_len_tokens >= {n}")
        if not any(ex.target[1:]):
            raise ValueError(f"example {i} has no assistant tokens to train on")
        tokens[i, :n] = torch.tensor(ex.ids[:-1])
        labels[i, :n] = torch.tensor(ex.ids[1:])
        loss_mask[i, :n] = torch.tensor(ex.target[1:], dtype=torch.float32)  # position j predicts ids[j+1]
    return Batch(tokens, labels, loss_mask)


@checked_args(seq_len_tokens=COUNT, global_batch=COUNT, seed=INDEX, num_batches=optional(COUNT))
def batches(items: list, tokenizer, *, seq_len_tokens: int, global_batch: int, seed: int = 0,
            num_batches: int | None = None) -> Iterator[Batch]:
    """Global batches of `global_batch` sequences (items as `tokenize_sft` takes them), reshuffled each epoch
    (deterministic by seed). Epochs are one stream: a batch may span the end of one shuffle and the start of the
    next, so no example is dropped. Endless unless num_batches is given. `train.step` packs them (`packing`)."""
    data = tokenize_sft(items, tokenizer, seq_len_tokens=seq_len_tokens)
    order, epoch, made = torch.empty(0, dtype=torch.long), 0, 0
    while num_batches is None or made < num_batches:
        while len(order) < global_batch:
            gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
            order, epoch = torch.cat([order, torch.randperm(data.num_sequences, generator=gen)]), epoch + 1
        idx, order = order[:global_batch], order[global_batch:]
        yield Batch(data.tokens[idx], data.labels[idx], data.loss_mask[idx])
        made += 1


# ---- user data -----------------------------------------------------------------------------
ROLES = ("system", "user", "assistant")
_SHAPES = ('{"prompt": str, "response": str} or '
           '{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]} '
           'ending with an assistant message')


def render_chat(messages: list[dict], tokenizer=None, *, add_generation_prompt: bool = True) -> str:
    """`messages` as the tokenizer's chat template writes them (None: the tiny tokenizer's)."""
    return chat.render(tokenizer or tiny_tokenizer(), messages, add_generation_prompt=add_generation_prompt)


def _row_messages(row, where: str) -> list[dict]:
    if isinstance(row, dict) and isinstance(row.get("prompt"), str) and isinstance(row.get("response"), str):
        return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
    if isinstance(row, dict) and isinstance(row.get("messages"), list):
        return _checked_messages(row["messages"], where)
    have = sorted(row) if isinstance(row, dict) else type(row).__name__
    raise ValueError(f"{where}: missing 'prompt'+'response' (strings) or 'messages' (list); "
                     f"the row has {have}; accepted shapes: {_SHAPES}")


def _checked_messages(messages: list, where: str) -> list[dict]:
    for j, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: messages[{j}] needs 'role' in {ROLES} and a string 'content'; "
                             f"got {m!r}; accepted shapes: {_SHAPES}")
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError(f"{where}: the last message must be the assistant's response; "
                         f"accepted shapes: {_SHAPES}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _rows(path) -> Iterator[tuple[str, object]]:
    """("file:line", parsed row) for each non-blank line of a JSONL file (lines count from 1)."""
    path = pathlib.Path(path)
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
        yield f"{path}:{lineno}", row


def load_jsonl(path, tokenizer) -> list[Example]:
    """Conversations from a JSONL file, rendered by `tokenizer`'s chat template and tokenized.

    Rows: {"prompt", "response"} (one user turn, one assistant turn) or {"messages"} (every
    assistant message is trained on; the last message must be the assistant's). Blank lines are
    skipped. Errors name the file and the 1-based line number, including a row the template
    refuses (e.g. a system message a template raises on)."""
    chat.require_template(tokenizer)
    examples = [Example(*map(tuple, chat.encode(tokenizer, _row_messages(row, where), where=where)))
                for where, row in _rows(path)]
    if not examples:
        raise ValueError(f"{path} is empty: no rows; accepted shapes: {_SHAPES}")
    return examples


def load_prompts_jsonl(path, tokenizer) -> list[tuple[str, str]]:
    """(prompt rendered up to the generation prompt, answer) pairs for RL (`rl.grpo.fit`'s
    prompt_pool) and evaluation: rows {"prompt": str, "answer": str} or {"messages": [...ending
    with a user message], "answer": str}. The reward function gets the rendered prompt and the
    completion. Errors name the file and line."""
    chat.require_template(tokenizer)
    out = []
    for where, row in _rows(path):
        shape = ('{"prompt": str, "answer": str} or {"messages": [{"role": ..., "content": str}, ...] ending with '
                 'a user message, "answer": str}')
        row = row if isinstance(row, dict) else {}
        messages = [{"role": "user", "content": row["prompt"]}] if isinstance(row.get("prompt"), str) else row.get("messages")
        if not (isinstance(row.get("answer"), str) and isinstance(messages, list) and messages
                and all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                        for m in messages) and messages[-1]["role"] == "user"):
            raise ValueError(f"{where}: a prompt row is {shape}")
        out.append((chat.render(tokenizer, messages, add_generation_prompt=True, where=where), row["answer"]))
    if not out:
        raise ValueError(f"{path} is empty: no rows")
    return out


# ---- synthetic tokens (parity tests, benchmarks) --------------------------------------------
@checked_args(steps=COUNT, global_batch=COUNT, seq_len_tokens=COUNT, vocab_size=COUNT, masked_fraction=number_in(0, 1))
def random_token_batches(*, steps: int, global_batch: int, seq_len_tokens: int, vocab_size: int, seed: int = 0,
                         masked_fraction: float = 0.0) -> list[Batch]:
    """`steps` batches of uniform random tokens, deterministic by seed. `masked_fraction` > 0 drops that share of
    positions from the loss at random, so data-parallel ranks see uneven token counts (what makes per-token loss
    averaging matter); at 0 every position counts and no mask randomness is drawn."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        toks = torch.randint(0, vocab_size, (global_batch, seq_len_tokens + 1), generator=g)
        mask = torch.ones(global_batch, seq_len_tokens) if masked_fraction == 0 else \
            (torch.rand(global_batch, seq_len_tokens, generator=g) > masked_fraction).float()
        out.append(Batch(toks[:, :-1], toks[:, 1:], mask))
    return out
