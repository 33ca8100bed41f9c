"""megatron's fused functions compile at their first call, not at import (megatron-core 0.16.1).

megatron/core/jit.py:21 sets `jit_fuser = torch.compile`, and modules decorate their fusions with
it at import (fusions/fused_bias_geglu.py, fused_bias_swiglu.py, ...). `torch.compile(fn)` imports
torch._dynamo and torch._inductor on the spot: most of `import megatron.core`, itself about half of
an engine's start (measured: docs/benchmarks.md, cluster_start), paid by every engine and test process
whether a fusion runs or not.
`torch.compile` compiles only at the first call anyway, so compiling at the first call gives the
same function at the same moment: only the import of the compiler moves there.

`compat.apply("lazy_compile")` (through `startup`, before megatron's import; imports nothing) puts a one-shot finder on sys.meta_path
that loads megatron.core.jit normally, then swaps its `jit_fuser` for `lazy(compile_tokens_dynamic)`
(`torch.compile` with the token dim symbolic: one compile per fusion whatever the token count). If
megatron was imported before mfsdp_kit, nothing changes: its import was paid already.
"""
from __future__ import annotations

import functools
import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import PathFinder

from ..registry import Patch, record

TARGET = "megatron.core.jit"
PATCH = Patch(target=TARGET, upstream="megatron/core/jit.py:21 (jit_fuser = torch.compile, applied at import)",
              needed_if="jit_fuser = torch.compile")


def lazy(compile_fn):
    """A decorator like `compile_fn` (torch.compile) that calls it on the function's first call."""
    def decorate(fn=None, **options):
        if fn is None:   # used as @jit_fuser(...) with options
            return lambda f: decorate(f, **options)
        compiled = None

        @functools.wraps(fn)
        def first_call_compiles(*args, **kwargs):
            nonlocal compiled
            if _compiling():   # called from another compiled fusion (megatron's bias_swiglu -> swiglu): dynamo
                return fn(*args, **kwargs)   # inlines fn (no guard on `compiled`, nothing it may not trace)
            if compiled is None:
                compiled = compile_fn(fn, **options)
            return compiled(*args, **kwargs)
        return first_call_compiles
    return decorate


def _compiling() -> bool:
    """Whether dynamo is tracing the caller (torch imported only once it is: this module imports nothing)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def compile_tokens_dynamic(fn, **options):
    """`torch.compile(fn)` whose tensor arguments have a symbolic dim 0 (tokens) from the first compile, every other
    size static. Packed rows change their token count every micro-batch: torch's default compiles a static graph
    first and a dynamic one at the second size; `dynamic=True` makes every size symbolic, and its kernels, indexing
    hidden dims by runtime values, made a GRPO update slower (docs/benchmarks.md, grpo_iteration, "fused kernels by
    default, and two rollout ideas that lost")."""
    import torch
    compiled = torch.compile(fn, **options)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() > 0:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return compiled(*args, **kwargs)
    return call


def _patch(module) -> None:
    import torch
    if module.jit_fuser is torch.compile:
        module.jit_fuser = lazy(compile_tokens_dynamic)
        record(PATCH)


class _Finder(MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)   # one shot
        spec = PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _patch(module)
        spec.loader.exec_module = exec_module
        return spec


def _install() -> None:
    """Arrange for megatron.core.jit to be patched when it is imported (a no-op once it is)."""
    if TARGET in sys.modules:
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
