"""Command-line options made from the kit's config dataclasses, so a bench script never re-spells a config.

The naive script writes one `add_argument` per config field it exposes, with its own type, default and help,
then copies each parsed value into the config by hand: two more places per field that drift from the dataclass
(a renamed field, a new allowed value, a changed default). `add_options` instead makes the options from the
dataclass itself: the flag from the field's name (`--<prefix>-<field>`, or an older spelling the script keeps in
`names`), the type and choices from its annotation, the help from the docstring written under the field; and
`build` makes the config from the parsed options. A script changes only what it must: `defaults` (a benchmark's
own starting point, also for a field the dataclass requires: `StepOptions.micro_batch_size`) and `skip` (fields it
computes itself). A field no command line spells (a function, a scheduler) gets no option: the script gives it to
`build`.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Literal

from ..fieldtypes import field_docs, field_types


def _dest(prefix: str, name: str) -> str:
    return f"{prefix}_{name}" if prefix else name


def _optional_bool(text: str) -> bool | None:
    """A `bool | None` field's option value: true | false | none."""
    values = {"true": True, "false": False, "none": None}
    if text.lower() not in values:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed true | false | none")
    return values[text.lower()]


def _parser_type(annotation) -> tuple[Any, tuple | None, bool] | None:
    """(argparse type, choices, optional) for a field's annotation; None where a command line cannot spell it."""
    args = typing.get_args(annotation)
    optional = typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        annotation = next(a for a in args if a is not type(None))
    if optional and annotation is bool:   # --packed true | false | none
        return _optional_bool, None, optional
    if typing.get_origin(annotation) is Literal:
        return type(typing.get_args(annotation)[0]), typing.get_args(annotation), optional
    return (annotation, None, optional) if annotation in (int, float, str) else None


def add_options(parser: argparse.ArgumentParser, cls: type, *, prefix: str, defaults: dict | None = None,
                names: dict[str, str] | None = None, skip: tuple[str, ...] = (), title: str | None = None) -> None:
    """One option per field of the dataclass `cls` (less `skip`, less a required field `defaults` does not name,
    less one no command line spells): `--<prefix>-<field with dashes>` or `--<prefix>-<names[field]>`; defaults
    from `defaults`, else the field's own."""
    defaults, names = defaults or {}, names or {}
    group = parser.add_argument_group(title or (f"{cls.__name__} ({prefix})" if prefix else cls.__name__))
    docs = field_docs(cls)
    for name, (annotation, default) in field_types(cls).items():
        value = defaults.get(name, default)
        if name in skip or value is dataclasses.MISSING or (annotation is not bool and not _parser_type(annotation)):
            continue
        flag = "--" + "-".join(filter(None, (prefix, names.get(name, name).replace("_", "-"))))
        doc = docs.get(name, "").split("\n\n")[0].replace("%", "%%")
        help_text = f"{doc} ({cls.__name__}.{name}; default {value!r})"
        if annotation is bool:
            group.add_argument(flag, dest=_dest(prefix, name), action=argparse.BooleanOptionalAction, default=value,
                               help=help_text)
            continue
        kind, choices, _ = _parser_type(annotation)
        group.add_argument(flag, dest=_dest(prefix, name), type=kind, choices=choices, default=value, help=help_text)


def build(cls: type, args: argparse.Namespace, *, prefix: str, **fixed):
    """`cls(**options)` from what `add_options(..., cls, prefix=prefix)` parsed, with `fixed` fields set by the
    script (they win)."""
    values = {name: getattr(args, _dest(prefix, name)) for name in field_types(cls)
              if hasattr(args, _dest(prefix, name))}
    return cls(**{**values, **fixed})
