"""`EngineConfig`'s old flat names, kept working until `REMOVED_IN`: `EngineConfig(tensor_model_parallel_size=2)`
still builds `parallelism.tensor_model_parallel_size=2`, and `cfg.tensor_model_parallel_size` still reads (and
assigns) it; each use warns (`DeprecationWarning`) naming the nested spelling, reads too, so the flat names do not
live on in tab completion unnoticed. HSDP's old door, the `override_ddp_config` key
`num_distributed_optimizer_instances`, moves into `parallelism.data_parallel_replicate_size` the same way.

The naive shim would copy every section field into a second flat list; here the flat names are derived from
the sections (`FLAT_NAMES`), so a field added to a section can never be missing from the compatibility layer.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
import warnings
from typing import Any

from .sections import SECTIONS

FLAT_NAMES: dict[str, str] = {f.name: f"{section}.{f.name}" for section, cls in SECTIONS.items()
                              for f in dataclasses.fields(cls)}
"""Old flat EngineConfig field -> its field now, "section.name"."""
REMOVED_IN = "0.2.0"
"""The mfsdp_kit release without the flat names and HSDP's old key (the minor release after 0.1.0)."""
HSDP_KEY = "num_distributed_optimizer_instances"
HSDP_FIELD = "parallelism.data_parallel_replicate_size"


def _deprecated(old: str, new: str, stacklevel: int) -> None:
    section, name = new.split(".")
    _warn(f"EngineConfig({old}=...) is deprecated: set {new} instead, e.g. EngineConfig({section}="
          f"{SECTIONS[section].__name__}({name}=...))", stacklevel + 1)


def _warn(message: str, stacklevel: int) -> None:
    warnings.warn(f"{message}; removed in mfsdp_kit {REMOVED_IN}", DeprecationWarning,
                  stacklevel=stacklevel + 1)


def nest(kwargs: dict[str, Any], *, stacklevel: int | None = None) -> dict[str, Any]:
    """`kwargs` with every flat name moved into its section (a new section object: the one passed is not
    changed). `stacklevel`: warn for each flat name at that frame, counted as warnings.warn counts from the
    caller; None: no warning."""
    out = {k: v for k, v in kwargs.items() if k not in FLAT_NAMES}
    moved: dict[str, dict[str, Any]] = {}
    for name in (k for k in kwargs if k in FLAT_NAMES):
        if stacklevel is not None:
            _deprecated(name, FLAT_NAMES[name], stacklevel + 1)
        moved.setdefault(FLAT_NAMES[name].split(".")[0], {})[name] = kwargs[name]
    for section, values in moved.items():
        base = out.get(section)
        out[section] = dataclasses.replace(SECTIONS[section]() if base is None else base, **values)
    return out


def hsdp_from_override(cfg: Any, *, stacklevel: int) -> None:
    """Move `wrapper.override_ddp_config["num_distributed_optimizer_instances"]` into
    `parallelism.data_parallel_replicate_size` (a new dict and sections; the caller's dict is not changed).
    A key that disagrees with a field already set stays where it is, for `validate` to refuse. `stacklevel`: the
    warning's frame, counted as warnings.warn counts from the caller."""
    overrides = cfg.wrapper.override_ddp_config
    if not isinstance(overrides, dict) or HSDP_KEY not in overrides:
        return
    _deprecated(f'override_ddp_config={{"{HSDP_KEY}": ...}}', HSDP_FIELD, stacklevel + 1)
    k, field_now = overrides[HSDP_KEY], cfg.parallelism.data_parallel_replicate_size
    if field_now not in (1, k):
        return
    cfg.wrapper = dataclasses.replace(cfg.wrapper, override_ddp_config={
        key: v for key, v in overrides.items() if key != HSDP_KEY})
    cfg.parallelism = dataclasses.replace(cfg.parallelism, data_parallel_replicate_size=k)


def _alias(path: str) -> property:
    section, name = path.split(".")

    def get(self):   # stacklevel 2: the line that read it
        _warn(f"EngineConfig.{name} is deprecated: read cfg.{path} instead", 2)
        return getattr(getattr(self, section), name)

    def put(self, value):   # a new section: configs made by dataclasses.replace share theirs
        _warn(f"EngineConfig.{name} = ... is deprecated: assign cfg.{path} instead", 2)
        setattr(self, section, dataclasses.replace(getattr(self, section), **{name: value}))
    return property(get, put, doc=f"Deprecated (goes in {REMOVED_IN}): the old flat name of `{path}`; reads and "
                                  "assignments go there and warn.")


def accept_flat(cls: type) -> type:
    """Class decorator for EngineConfig: its constructor takes the flat names too, and each flat name is a
    property reading and assigning the section's field; every use warns."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, **kwargs):
        init(self, **nest(kwargs, stacklevel=2))
    cls.__init__ = __init__
    for name, path in FLAT_NAMES.items():
        setattr(cls, name, _alias(path))
    return cls


def leaf_fields(cls: type) -> dict[str, tuple[str, Any, Any]]:
    """Flat name -> (path, annotation, default) of every value field of `cls` (EngineConfig): its own fields
    (path = name) and its sections' (path = "section.name"); the sections themselves are not listed."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in SECTIONS:
            out[f.name] = (f.name, hints[f.name], _default(f))
            continue
        section_hints = typing.get_type_hints(SECTIONS[f.name])
        for g in dataclasses.fields(SECTIONS[f.name]):
            out[g.name] = (f"{f.name}.{g.name}", section_hints[g.name], _default(g))
    return out


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def flat_values(cfg: Any) -> dict[str, Any]:
    """Flat name -> value of every value field of an EngineConfig (what `to_dict` gave before the sections), read
    by path: the flat properties warn."""
    return {name: functools.reduce(getattr, path.split("."), cfg) for name, (path, _, _) in
            leaf_fields(type(cfg)).items()}
