"""One torch.compile cache per ATEN_CPU_CAPABILITY, so a CPU capability change never reuses foreign kernels.

Inductor caches compiled graphs (FX graph cache) under TORCHINDUCTOR_CACHE_DIR, by default one folder per
user. The cache key (torch/_inductor/codecache.py, torch 2.13) does not include ATEN_CPU_CAPABILITY, the
switch that picks ATen's kernels and inductor's vector ISA (cpu_vec_isa.py:657). A graph compiled at the
machine's native capability holds AVX-512 C++ (`at::vec::Vectorized<float>` loops); a later process under
ATEN_CPU_CAPABILITY=default hits the same key, takes that source and compiles it without the AVX headers:
"error: 'at::vec' has not been declared", and the step fails. Seen in `make test` here: the native run
filled the cache, then every default-capability run that compiled the same row-max failed
(bench/load_hf.py; the Makefile's portable pass runs on the same machine).

`compat.apply("inductor_cache")` (through `startup`, before anything compiles): when ATEN_CPU_CAPABILITY is set and the
user chose no TORCHINDUCTOR_CACHE_DIR, the cache goes to inductor's default folder + "_<capability>".
Child processes (torchrun ranks, engines) inherit the variable, so they agree on the folder. A process-wide
setting, so a row of compat.registry (`PATCH`, recorded when the variable is set); tests/compat/
test_inductor_cache.py fails when torch starts keying on the capability: delete this then.
"""
from __future__ import annotations

import getpass
import inspect
import os
import tempfile

from ..registry import Patch, record


def still_needed() -> bool:
    """True while inductor's cache code does not mention the capability (so cannot key on it)."""
    import torch._inductor.codecache as codecache
    return "ATEN_CPU_CAPABILITY" not in inspect.getsource(codecache)


PATCH = Patch(target="torch._inductor.codecache", package="torch", needed_if=lambda: still_needed(),
              upstream="torch/_inductor/codecache.py (FX graph cache key without ATEN_CPU_CAPABILITY) and "
                       "cpu_vec_isa.py:657 (the ISA the capability picks); sets TORCHINDUCTOR_CACHE_DIR, torch 2.13")


def cache_dir(capability: str) -> str:
    """Inductor's default cache folder (torch/_inductor/runtime/cache_dir_utils.py), per capability."""
    user = "".join(c if c.isalnum() else "_" for c in getpass.getuser())
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}_{capability}")


def _install() -> str | None:
    """Point inductor at a per-capability cache if a capability is forced; returns the folder set (or None)."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if not capability or "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir(capability)
    record(PATCH)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]
