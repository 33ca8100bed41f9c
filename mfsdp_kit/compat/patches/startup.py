"""The kit's process-wide installs, made by `runtime.init` (or an engine's boot), never by `import mfsdp_kit`.

Four changes concern a whole process rather than a model, and each must come before something else happens:
- `lazy_compile`: megatron's fusions compile at their first call (before megatron.core.jit is imported);
- `lazy_cpp_extension`: megatron's allocators import torch.utils.cpp_extension when built (before
  megatron.core is imported);
- `inductor_cache`: one torch.compile cache per forced ATEN_CPU_CAPABILITY (before anything compiles);
and `quiet`: the third-party warnings the kit knows are benign here, filtered (before megatron's import warns).
Importing the kit installs none of them: a user who imports `mfsdp_kit` for its config or its checkpoint reader
gets torch and megatron as they ship. `compat.apply("startup")` is idempotent; it is called first thing by `runtime.init`,
by an engine's boot (`ipengine.start`, `cluster`'s engine init) and by the test harness, all of which import
megatron right after. A process that imports megatron before calling any of them pays megatron's import as it
ships (the two lazy rows change nothing then) and gets the same numbers.
"""
from __future__ import annotations

from ..door import apply


def _install() -> None:
    """Install the four (each a no-op where its moment has passed or it is installed already)."""
    apply("lazy_compile")         # before anything imports megatron: its fusions compile at first use
    apply("lazy_cpp_extension")   # and its NCCL allocator imports torch.utils.cpp_extension when it is built
    apply("inductor_cache")       # before anything compiles: one torch.compile cache per forced CPU capability
    apply("quiet")                # before megatron's import-time warnings: the benign ones, listed in quiet.KNOWN
