"""Does a dataclass field hold what its annotation says? The checks behind every config's `validate()`.

A dataclass's annotations are the contract; dataclasses do not enforce them, and megatron fails (or
silently misbehaves) long after the process group exists: "yes" is truthy, True is the size 1, "2" * 64
is a string. The checker knows the plain kinds below and skips the rest (Callables, torch.dtype, enums,
megatron's own classes) rather than guess. `ConfigError` / `bad_value` are the one message shape of a
configuration mistake: field, value, what is allowed. `checked_args` applies the same to a public
function's numeric arguments at the call (`train.step(micro_batch_size=0)` once died in a ZeroDivisionError,
-1 in a bare StopIteration, True trained with micro-batches of 1).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import types
import typing
from typing import Any, Callable, Literal


class ConfigError(ValueError):
    """A config field holds a value that is not allowed; the message names both."""


def bad_value(field_name: str, value: Any, allowed: str) -> ConfigError:
    """The one message shape of every config mistake: field, value, what is allowed."""
    return ConfigError(f"{field_name}={value!r} is not allowed; allowed: {allowed}")


def kind(tp: Any) -> tuple[Callable[[Any], bool], str] | None:
    """(accepts(value), what is allowed) for annotation `tp`, or None when the checker does not know it."""
    if tp is bool:
        return (lambda v: isinstance(v, bool)), "True | False"
    if tp is int:
        return is_int, "an integer"
    if tp is float:   # an int is a fine float; a bool is not
        return (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)), "a number"
    if tp is str:
        return (lambda v: isinstance(v, str)), "a string"
    if tp is type(None):
        return (lambda v: v is None), "None"
    if tp in (dict, list):
        return (lambda v: isinstance(v, tp)), f"a {tp.__name__}"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return (lambda v: any(v == a and type(v) is type(a) for a in args)), " | ".join(map(repr, args))
    if origin in (typing.Union, types.UnionType):
        kinds = [kind(a) for a in args]
        if None in kinds:   # Union[int, SomethingElse]: cannot say what is wrong
            return None
        return (lambda v: any(ok(v) for ok, _ in kinds)), " or ".join(text for _, text in kinds)
    return None


def type_error(field_name: str, value: Any, tp: Any, default: Any = dataclasses.MISSING) -> ConfigError | None:
    """A `ConfigError` when `value` does not fit annotation `tp`, else None (also for kinds it does not know).

    The field's own default always fits (megatron declares `int = None` in places)."""
    known = kind(tp)
    if known is None or known[0](value) or (default is not dataclasses.MISSING and value is default):
        return None
    return bad_value(field_name, value, known[1])


def check_field_types(obj: Any, *, prefix: str = "") -> None:
    """Every field of dataclass `obj` holds what its annotation says (as far as `kind` knows); the error names
    the field as `prefix` + name (a config section: "parallelism.")."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if err := type_error(prefix + f.name, getattr(obj, f.name), hints[f.name], f.default):
            raise err


def field_types(cls: type) -> dict[str, tuple[Any, Any]]:
    """field name -> (annotation, default) of a dataclass (megatron's configs)."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.default) for f in dataclasses.fields(cls)}


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def finite(value: Any) -> bool:
    return math.isfinite(value)


Range = tuple[Callable[[Any], bool], str]
"""(accepts(value), what is allowed) of one argument."""


def at_least(n: int) -> Range:
    """An integer >= n; a bool is not an integer, nor is 2.0 or "2"."""
    return (lambda v: is_int(v) and v >= n), f"an integer >= {n}"


COUNT, INDEX = at_least(1), at_least(0)
"""A size or count (micro_batch_size, steps, global_batch, ...); a position (step_index, start_step, seed)."""


def optional(r: Range) -> Range:
    return (lambda v: v is None or r[0](v)), f"None or {r[1]}"


def number_in(low: float, high: float = math.inf, *, low_open: bool = False) -> Range:
    """A finite int or float in [low, high] ((low, high] with `low_open`); not a bool."""
    def ok(v) -> bool:
        return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                and (v > low if low_open else v >= low) and v <= high)
    if high == math.inf:
        return ok, f"a finite number {'>' if low_open else '>='} {low}"
    return ok, f"a number in {'(' if low_open else '['}{low}, {high}]"


def check_fields(obj: Any, **ranges: Range) -> None:
    """A dataclass's fields' types (`check_field_types`), then each field named in `ranges` against its range
    (`check_ranges`)."""
    check_field_types(obj)
    check_ranges(obj, ranges)


def check_ranges(obj: Any, ranges: dict[str, Range]) -> None:
    """Each field of `obj` named in `ranges` against its range, in order: the first bad one raises `bad_value`'s
    ConfigError (field, value, allowed). No type walk: cheap enough for an object made at every call."""
    for name, (ok, allowed) in ranges.items():
        if not ok(getattr(obj, name)):
            raise bad_value(name, getattr(obj, name), allowed)


def checked_args(**ranges: Range):
    """Decorator: the arguments named in `ranges` are checked when the function is called, before its body runs,
    with `bad_value`'s message (argument, value, allowed). Arguments left at their default are not checked."""
    def wrap(fn):
        signature = inspect.signature(fn)
        missing = set(ranges) - set(signature.parameters)
        assert not missing, f"{fn.__qualname__} has no argument(s) {sorted(missing)}"

        @functools.wraps(fn)
        def call(*args, **kwargs):
            given = signature.bind(*args, **kwargs).arguments   # a wrong call: Python's own TypeError
            for name, (ok, allowed) in ranges.items():
                if name in given and not ok(given[name]):
                    raise bad_value(name, given[name], allowed)
            return fn(*args, **kwargs)
        return call
    return wrap


def field_docs(cls: type) -> dict[str, str]:
    """field name -> the docstring written under it (torchtitan's style), over the class and its dataclass bases."""
    import ast
    import textwrap
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                out[node.target.id] = inspect.cleandoc(after.value.value)
    return out
