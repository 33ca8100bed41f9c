"""megatron imports torch.utils.cpp_extension when it builds an allocator, not at import (megatron-core 0.16.1).

Two megatron modules import cpp_extension at module level, and `import megatron.core` reaches both:
- megatron/core/nccl_allocator.py:11 `from torch.utils import cpp_extension` (through
  distributed/param_and_grad_buffer.py:15); used at one place, `_build_nccl_allocator` (line 87:
  `torch.utils.cpp_extension.load_inline`, the NCCL allocator behind Megatron-FSDP's `nccl_ub` option);
- megatron/core/inference/unified_memory.py:14 `from torch.utils.cpp_extension import CUDA_HOME, load_inline`
  (through inference_params -> inference.contexts.dynamic_context); both names used only in
  `compile_allocator` (lines 213-219, the unified-memory pool of dynamic inference).
cpp_extension imports setuptools, distutils and packaging: 0.04-0.06 s on an idle 2-core CPU, 0.7 s of an
engine's start on a GPU node (docs/benchmarks.md, "cluster_start"), paid by every engine and test process
whether an allocator is ever built or not.

`compat.apply("lazy_cpp_extension")` (through `startup`; imports nothing) puts a finder on sys.meta_path that loads each of the
two modules from its source with that one import line blanked (line numbers stay; the bytecode cache is
neither read nor written), then makes the uses import cpp_extension on the spot: the function that needs it
binds the names the line bound before it runs (the module's other functions look it up at call time, so they
all get the wrapper), and a module `__getattr__` answers `module.<name>` from outside. If cpp_extension was
imported before mfsdp_kit, nothing changes: its import was paid already.
"""
from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass
from importlib.abc import MetaPathFinder
from importlib.machinery import PathFinder, SourceFileLoader
from importlib.util import decode_source

from ..registry import Patch, record

DEFERRED = "torch.utils.cpp_extension"


@dataclass(frozen=True)
class Deferral:
    """One module-level import of cpp_extension, and the function that is its only user."""

    line: str
    """The import statement, exactly as upstream writes it on one line."""
    names: tuple[str, ...]
    """What it binds: the module itself (`cpp_extension`) or names from it."""
    user: str
    """The module's function that reads those names."""
    patch: Patch


TARGETS = {
    "megatron.core.nccl_allocator": Deferral(
        "from torch.utils import cpp_extension", ("cpp_extension",), "_build_nccl_allocator",
        Patch(target="megatron.core.nccl_allocator", needed_if="from torch.utils import cpp_extension",
              upstream="megatron/core/nccl_allocator.py:11 (cpp_extension imported at module level; used at "
                       "line 87 only, in _build_nccl_allocator)")),
    "megatron.core.inference.unified_memory": Deferral(
        "from torch.utils.cpp_extension import CUDA_HOME, load_inline", ("CUDA_HOME", "load_inline"),
        "compile_allocator",
        Patch(target="megatron.core.inference.unified_memory",
              needed_if="from torch.utils.cpp_extension import CUDA_HOME, load_inline",
              upstream="megatron/core/inference/unified_memory.py:14 (CUDA_HOME, load_inline imported at module "
                       "level; used at lines 213-219 only, in compile_allocator)")),
}


def without_line(source: str, line: str) -> str | None:
    """`source` with `line` blanked (same line count), or None unless it appears exactly once."""
    lines = source.splitlines(keepends=True)
    hits = [i for i, text in enumerate(lines) if text.strip() == line]
    if len(hits) != 1:
        return None
    lines[hits[0]] = "\n"
    return "".join(lines)


def _bind(module, deferral: Deferral) -> None:
    """Import cpp_extension and give `module` the names its import line gave it."""
    cpp_extension = importlib.import_module(DEFERRED)
    for name in deferral.names:
        setattr(module, name, cpp_extension if name == "cpp_extension" else getattr(cpp_extension, name))


def _patch(module, deferral: Deferral) -> None:
    user = getattr(module, deferral.user)

    @functools.wraps(user)
    def first_call_imports(*args, **kwargs):
        _bind(module, deferral)
        return user(*args, **kwargs)

    def __getattr__(name: str):
        if name in deferral.names:
            _bind(module, deferral)
            return module.__dict__[name]
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

    setattr(module, deferral.user, first_call_imports)
    module.__getattr__ = __getattr__
    record(deferral.patch)


class _Loader(SourceFileLoader):
    """Compiles the module from its source minus the import line; the .pyc cache (upstream's code) is left alone."""

    def get_code(self, fullname):
        source = decode_source(self.get_data(self.path))
        edited = without_line(source, TARGETS[fullname].line) if DEFERRED not in sys.modules else None
        self.deferred = edited is not None
        return compile(edited or source, self.path, "exec", dont_inherit=True)

    def exec_module(self, module):
        super().exec_module(module)
        if self.deferred:
            _patch(module, TARGETS[module.__name__])


class _Finder(MetaPathFinder):
    def __init__(self) -> None:
        self.found: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS:
            return None
        self.found.add(fullname)
        if self.found == TARGETS.keys():
            sys.meta_path.remove(self)   # each target is loaded once
        spec = PathFinder.find_spec(fullname, path)
        if spec is None or type(spec.loader) is not SourceFileLoader or DEFERRED in sys.modules:
            return spec
        spec.loader = _Loader(fullname, spec.origin)
        return spec


def _install() -> None:
    """Arrange for the TARGETS to load without importing cpp_extension (a no-op once it is imported)."""
    if DEFERRED in sys.modules:
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
