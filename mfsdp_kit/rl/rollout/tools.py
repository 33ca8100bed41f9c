"""Tools a rollout row may call mid-completion (multi-turn, tool-using rollouts), and a safe calculator.

A row calls a tool by writing its call and the tool's `stop` string (`<calc>1234+5678</calc>`). The naive agent loop
(a chat client around a server, or `generate` in a Python loop) ends the sequence at the stop, runs the tool, appends
its output to the text and sends prompt + everything so far back as a new prompt: each turn prefills the whole
sequence again, so a row of t turns computes its prompt t times, and the batch waits for the slowest row's tool.
The kit's engine (`scheduler.Scheduler`, `model_runner.ModelRunner`) instead pauses the row at the host's check
point, runs the tool while the row takes no part in the decode steps, then prefills only the tool's output into the
row's own KV cache (`decoder.extend`: the output attends to the cached prefix) and resumes decoding: nothing before
the output is recomputed.

What the trainer sees: the completion is every token (the model's and the tools'), `model_mask` marks the model's
own with 1, and only those carry log-probs and sit in the loss (`rl.core.rollout_batch`): a tool's output is
context the policy conditions on, not an action it took (verl's agent loop's `response_mask`).

The calculator evaluates arithmetic without `eval`: the expression is parsed by `ast` and only numbers, + - * / //
% ** and unary signs are walked, with limits on its length, its powers and its result's size; anything else is a
`ToolError` that names the problem, which the row sees as the tool's output ("error: ...").
"""
from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from typing import Callable

from ...fieldtypes import COUNT, INDEX, check_fields


class ToolError(ValueError):
    """A tool refused its input; the message becomes the tool's output ("error: <message>") for the row to read."""


@dataclass(frozen=True, kw_only=True)
class Tool:
    """One tool a row can call: the text between `start` and `stop` is the call, `fn(call)` the output's text."""

    name: str
    """What the tool is called in stats and errors."""
    stop: str
    """The text that ends a call: the host's check finds it in the decoded tail of the row's current turn."""
    fn: Callable[[str], str]
    """call text -> output text (prefilled into the row); raise `ToolError` (a ValueError) for bad input."""
    start: str = ""
    """The text that opens a call: the call is what follows its last occurrence in the turn ("" or absent: the
    whole turn before `stop`)."""
    max_output_tokens: int = 32
    """The output's tokens are cut to this many (and to the room left under `max_new_tokens`)."""

    def __post_init__(self):
        check_fields(self, max_output_tokens=COUNT)
        if not self.stop:
            raise ToolError(f"tool {self.name!r}: stop must be a non-empty string")

    def call_text(self, turn: str) -> str:
        """The call in `turn` (the row's text since its last tool output, without `stop`)."""
        return turn.rpartition(self.start)[2] if self.start else turn

    def output(self, call: str) -> str:
        """fn(call), or "error: <message>" when it raises `ToolError` (any ValueError): the row sees what went
        wrong, as verl's tools return their error text."""
        try:
            return str(self.fn(call))
        except ValueError as e:
            return f"error: {e}"


@dataclass(kw_only=True)
class ToolConfig:
    """The tools `ContinuousRollout` offers every row, and the turn limit."""

    tools: tuple[Tool, ...] = ()
    """Checked in order: the first whose stop ends first in a row's new tokens is called."""
    max_calls: int = 4
    """Tool calls per row at most: a row that writes one more call ends at its stop (verl's max_assistant_turns)."""
    workers: int = 0
    """0: each call runs on the host thread when its row pauses (a fast tool: the calculator takes microseconds, a
    thread's hand-off ~ms); k > 0: on k threads, so one check point's slow calls (a sandbox, a search) wait together."""

    def __post_init__(self):
        check_fields(self, max_calls=COUNT, workers=INDEX)
        self.tools = tuple(self.tools)


TAIL_TOKENS = 16
"""Tokens before the new ones that the stop search decodes with them: a stop may begin up to this far back."""


def find_call(tokenizer, tokens: list[int], *, turn_start: int, new: int, tools) -> tuple[int, Tool] | None:
    """(n, tool): `tokens[:n]` ends with the first call that completes within the last `new` tokens of the turn
    `tokens[turn_start:]`, or None. A call is a tool's stop with the tool's `start` earlier in the turn (a stop alone,
    say a `)` in prose, is text, not a call). One decode of the turn's tail (the new tokens and `TAIL_TOKENS` before
    them: a check point's cost does not grow with the completion) rules most rows out; a hit is placed by decoding
    growing prefixes of the new tokens only (a stop is text, so it may span tokens or share one with other text)."""
    start = max(turn_start, len(tokens) - new - TAIL_TOKENS)
    text = tokenizer.decode(tokens[start:])
    hits = [t for t in tools if t.stop in text]
    if not hits:
        return None
    before = tokenizer.decode(tokens[start:len(tokens) - new])
    seen = [before.count(t.stop) for t in hits]   # per tool (names need not be unique)
    for n in range(len(tokens) - new + 1, len(tokens) + 1):
        prefix = tokenizer.decode(tokens[start:n])
        for i, tool in enumerate(hits):
            count = prefix.count(tool.stop)
            if count > seen[i]:   # a stop completed at token n
                seen[i] = count
                if opened(tokenizer, tokens[turn_start:n], tool):
                    return n, tool
    return None


def opened(tokenizer, turn: list[int], tool: Tool) -> bool:
    """Whether the turn, which ends with `tool`'s stop, holds the tool's start before that stop (no start: always)."""
    if not tool.start:
        return True
    text = tokenizer.decode(turn)
    return tool.start in text[:text.rfind(tool.stop)]


def joined_masks(masks: list, completions: list) -> list[list[int]] | None:
    """Model masks of several parts (ranks, batches) one after another; a part without one: all the model's tokens."""
    if all(m is None for m in masks):
        return None
    return [row for m, cs in zip(masks, completions) for row in (m or [[1] * len(c) for c in cs])]


# ---- the calculator --------------------------------------------------------------------------
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_CHARS = 200
"""Longest expression the calculator parses (the parse itself is the only cost before the walk)."""
MAX_EXPONENT = 100
"""Largest |exponent| of `**` (9**9**9 would take minutes and gigabytes)."""
MAX_DIGITS = 60
"""Largest result (and intermediate value), in decimal digits."""


def calculator(expression: str) -> str:
    """The value of an arithmetic expression as text: integers stay exact ("6912"), other results print as a
    float ("0.5"). Only numbers, + - * / // % **, unary signs and parentheses; `ToolError` names what else it met."""
    expr = expression.strip()
    if not expr:
        raise ToolError("empty expression")
    if len(expr) > MAX_CHARS:
        raise ToolError(f"expression of {len(expr)} characters; at most {MAX_CHARS}")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise ToolError(f"not an expression: {expr!r} ({e.msg})") from None
    value = _walk(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        value = int(value)
    return str(value)


def _walk(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_walk(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is too large; at most {MAX_EXPONENT}")
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result too large") from None
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise ToolError(f"{what} is not allowed: only numbers, + - * / // % ** and parentheses")


def _checked(value):
    if isinstance(value, complex):
        raise ToolError("complex result")
    if isinstance(value, int) and abs(value) >= 10 ** MAX_DIGITS:
        raise ToolError(f"result of more than {MAX_DIGITS} digits")
    return value


CALCULATOR = Tool(name="calculator", start="<calc>", stop="</calc>", fn=calculator, max_output_tokens=16)
"""The calculator called as `<calc>1234+5678</calc>`; a character-level tokenizer without < > (the kit's tiny
model) can use `Tool(name="calculator", start="calc(", stop=")", fn=calculator)` instead."""
