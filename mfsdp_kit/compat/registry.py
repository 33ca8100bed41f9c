"""One registry for every patch the kit applies to upstream code or to a process-wide setting (compat/patches/),
and for the private upstream APIs the kit calls (compat/access/aten.py).

Each row says what it changes (`target`), which upstream lines make it necessary (`upstream`,
file:line in the package version of `WRITTEN_FOR`), and how to tell it is still needed
(`needed_if`: a snippet of the target's upstream source whose presence proves the problem is
still there, or a function answering that). tests/compat/ asserts two things for every active row:
it is still needed (when upstream fixes the problem, the test fails: delete the patch), and the
installed package is the version the row was written for (a new version needs its file:line
references re-checked before anyone trusts them).
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Callable

WRITTEN_FOR = {"megatron-core": "0.16.1", "megatron-bridge": "0.3.1", "torch": "2.13"}
"""The upstream versions whose file:line references the patches cite. torch by major.minor: its local build tag
(+cpu, +cu130) differs between the CPU and GPU images, its private APIs do not."""


@dataclass(frozen=True)
class Patch:
    """One change to upstream code, with the evidence that it is needed."""

    target: str
    """Dotted module, or module:qualname, that the patch changes."""
    upstream: str
    """Upstream file:line(s) (relative to the package root) that make the patch necessary."""
    needed_if: str | Callable[[], bool]
    """Snippet of the target's unpatched source that proves the problem, or a check returning True
    while it persists."""
    package: str = "megatron-core"
    """The distribution whose code is patched (a key of WRITTEN_FOR)."""

    def still_needed(self) -> bool:
        if callable(self.needed_if):
            return bool(self.needed_if())
        return self.needed_if in upstream_source(self.target)


ACTIVE: list[Patch] = []
"""The patches applied in this process, in order."""


def record(patch: Patch) -> None:
    if patch.package not in WRITTEN_FOR:
        raise ValueError(f"package={patch.package!r} is not allowed; allowed: {' | '.join(WRITTEN_FOR)}")
    if patch not in ACTIVE:
        ACTIVE.append(patch)


def upstream_source(target: str) -> str:
    """The unpatched source of `target`: the function a module:qualname names (through a wrapper's
    `__wrapped__`), else the whole module (for replaced module attributes such as a class)."""
    name, _, qualname = target.partition(":")
    module = importlib.import_module(name)
    if not qualname:
        return inspect.getsource(module)
    owner = module
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    func = inspect.getattr_static(owner, attr, None)
    func = getattr(func, "__func__", func)
    func = getattr(func, "__wrapped__", func)
    if inspect.isfunction(func) and func.__module__ == name:
        return inspect.getsource(func)
    return inspect.getsource(module)


def installed_version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def written_for_installed(package: str) -> bool:
    """Is the installed `package` the version the rows were written for (torch: the same major.minor)?"""
    have, want = installed_version(package), WRITTEN_FOR[package]
    if have is None:
        return False
    return have == want or (package == "torch" and have.split("+")[0].startswith(want + "."))


def version_mismatches() -> dict[str, tuple[str, str | None]]:
    """{package: (written for, installed)} for every active patch's package whose version differs."""
    out = {}
    for package in sorted({p.package for p in ACTIVE}):
        have = installed_version(package)
        if not written_for_installed(package):
            out[package] = (WRITTEN_FOR[package], have)
    return out


def describe() -> str:
    """One line per active patch: target, then the upstream file:line it works around."""
    return "\n".join(f"{p.target}  <-  {p.package} {p.upstream}" for p in ACTIVE) or "(no patches active)"
