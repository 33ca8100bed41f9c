"""Rewards (`Reward`: a reward function and what counts as solved), and for real math data: GSM8K's `#### answer`
and MATH's `\\boxed{...}`, graded against a gold answer after normalisation, in the spirit of the common
math-verify rules (no network, no sympy): numbers compare as exact fractions ("1,234" = "1234.0", "0.5" = "1/2" =
"\\frac{1}{2}"), other answers as normalised LaTeX strings.

    problems = load_problems("train.jsonl", prompt_field="question", answer_field="answer")   # rl.problems
    reward = gold_reward(problems, grade=gsm8k)            # a Reward: fn(prompt, completion) -> 0 or 1
    grpo.fit(..., prompt_pool=problems, reward_fn=reward)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

import torch

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_GSM8K_MARK = "####"


@dataclass(frozen=True, kw_only=True)
class Reward:
    """A reward function and what counts as solved, so accuracy is the reward's own convention."""

    fn: Callable[[str, str], float]
    """`fn(prompt, completion_text) -> float`, e.g. `data.verify` (exact match, 0 or 1)."""
    solved_threshold: float = 1.0
    """A completion counts as solved when its reward >= this. 1.0 suits rewards in [0, 1] whose
    maximum means right (`data.verify`, `data.digit_match`: partial credit < 1 is not solved)."""

    def __call__(self, prompt: str, completion: str) -> float:
        return float(self.fn(prompt, completion))

    def solved(self, rewards: torch.Tensor) -> torch.Tensor:
        return rewards >= self.solved_threshold


def as_reward(reward_fn) -> Reward:
    """A `Reward` as is; a plain callable gets the default threshold (1.0: reward 1 = solved)."""
    return reward_fn if isinstance(reward_fn, Reward) else Reward(fn=reward_fn)


def extract_gsm8k(text: str) -> str | None:
    """The answer after the last `####` (GSM8K's gold format, and what a model trained on it writes), up to the
    line's end; None without one."""
    if _GSM8K_MARK not in text:
        return None
    answer = text.rsplit(_GSM8K_MARK, 1)[1].strip().splitlines()
    return answer[0].strip() if answer and answer[0].strip() else None


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None without a closed one."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


_DROP = (r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", "$", "^\\circ", "^{\\circ}", r"\%", "%", r"\$")


def _unbrace_frac(s: str) -> str:
    """`\\frac{a}{b}` -> `(a)/(b)` for simple a and b (digits or one symbol), `\\frac12` -> `1/2`."""
    s = re.sub(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\\[dt]?frac(\d)(\d)", r"\1/\2", s)
    return re.sub(r"\((-?\d+)\)/\((\d+)\)", r"\1/\2", s)


def normalize(answer: str) -> str:
    """An answer as compared: `\\text{...}` unwrapped, sizing and spacing macros, `$`, degrees and percent dropped,
    fractions as a/b, thousands commas removed, whitespace gone, a trailing period and outer braces gone."""
    s = answer.strip()
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    for token in _DROP:
        s = s.replace(token, "")
    s = _unbrace_frac(s)
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)           # 1,234,567 -> 1234567 (not "1,2" as in a pair)
    s = re.sub(r"\s+", "", s).rstrip(".")
    while s.startswith("{") and s.endswith("}") and extract_boxed("\\boxed" + s) == s[1:-1]:
        s = s[1:-1]                                          # {2} -> 2: braces around the whole answer
    return s


def as_number(answer: str) -> Fraction | None:
    """The normalised answer as an exact number (integer, decimal or a/b), or None when it is not one."""
    s = normalize(answer)
    if not _NUMBER.fullmatch(s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def equivalent(answer: str, gold: str) -> bool:
    """Whether two answers agree: equal as exact numbers, else equal as normalised strings."""
    a, g = as_number(answer), as_number(gold)
    if a is not None and g is not None:
        return a == g
    return normalize(answer) == normalize(gold) != ""


def _graded(extract: Callable[[str], str | None]) -> Callable[[str, str], float]:
    def grade(completion: str, gold: str) -> float:
        found = extract(completion)
        return float(found is not None and equivalent(found, extract(gold) or gold))
    return grade


gsm8k = _graded(extract_gsm8k)
gsm8k.__doc__ = """1.0 when the completion's `#### answer` equals the gold's (the gold's own `####` answer, or all of it)."""
math = _graded(extract_boxed)
math.__doc__ = """1.0 when the completion's last `\\boxed{}` equals the gold (its `\\boxed{}`, or all of it)."""


def gold_reward(problems: list[tuple[str, str]], *, grade: Callable[[str, str], float]) -> Reward:
    """A `core.Reward` for a prompt pool of (prompt, gold answer): each completion graded against its prompt's gold
    (rewards see the prompt and the completion only, so the gold is looked up by prompt)."""
    gold = dict(problems)

    def fn(prompt: str, completion: str) -> float:
        if prompt not in gold:
            raise KeyError(f"gold_reward: a prompt not in its problems ({prompt[:60]!r}...): build the reward from "
                           "the same list as the prompt pool")
        return grade(completion, gold[prompt])
    return Reward(fn=fn)
