"""rl's old names and keywords, kept working: each use warns once (`DeprecationWarning`) naming the new spelling.

Issue 70 made the loop one (`rl.loop`), the History one type (`loop.History`) and every RL config's keyword `cfg`;
`grpo.fit(gcfg=...)`, `dapo.DAPOHistory` and the like still run, through `renamed` and `aliases`.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

_warned: set[str] = set()


def warn_once(message: str, *, stacklevel: int) -> None:
    """A `DeprecationWarning` with `message`, the first time this process sees it (`stacklevel` as warnings.warn
    counts from the caller of `warn_once`)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)


def renamed(name: str, **old_to_new: str) -> Callable:
    """Decorator: the function also takes each old keyword for its new one (`renamed("grpo.fit", gcfg="cfg")`),
    warning once; both given: a TypeError."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{name}() got both {old}= and its new name {new}=")
                    warn_once(f"{name}({old}=...) is deprecated: pass {new}=... instead", stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return call
    return wrap


def aliases(module: str, old: dict[str, tuple[Any, str]]) -> Callable[[str], Any]:
    """A module's `__getattr__` serving its old names, {name: (the object, where it lives now)}, each warning once."""
    def __getattr__(name: str):
        if name not in old:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        obj, now = old[name]
        warn_once(f"{module}.{name} is deprecated: use {now}", stacklevel=2)
        return obj
    return __getattr__
