"""What the kit makes once per machine and keeps: tiny models, and the compiled bytecode of engines' imports.

Both live under `root()`: $MFSDP_KIT_CACHE, else ~/.cache/mfsdp_kit.

Bytecode. Python compiles each imported module's source and normally keeps the result (`__pycache__/*.pyc`)
so the next process only loads it. Container images often switch that off (`PYTHONDONTWRITEBYTECODE=1`, to keep
layers small), and shared cluster environments are often read-only, so the .pyc cannot be written. Then every
process compiles torch, sympy, megatron and ipyparallel from source, every time. On the GPU image this kit is
tested on, that made an engine's imports (mfsdp_kit, megatron.core, ipyparallel's engine) take 10.4-12.2 s per
start instead of 3.2 s with the bytecode kept (first start: 13.6 s while it is written; 54 MB). `bytecode_env`
gives the processes the kit starts (engines, `make lab`'s server and so its kernels) a bytecode folder of their
own under `root()` (`PYTHONPYCACHEPREFIX`): site-packages stay untouched, and nothing changes where Python
already keeps bytecode. `MFSDP_KIT_BYTECODE=0` keeps the environment exactly as it is.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

CACHE_ENV = "MFSDP_KIT_CACHE"
"""Folder for everything below (default ~/.cache/mfsdp_kit)."""
BYTECODE_ENV = "MFSDP_KIT_BYTECODE"
"""'0': `bytecode_env` changes nothing."""
PROBE_MODULE = "torch"
"""The heaviest import of an engine: where its bytecode would go decides whether the kit steps in."""


def root(environ=None) -> Path:
    """$MFSDP_KIT_CACHE, else ~/.cache/mfsdp_kit."""
    environ = os.environ if environ is None else environ
    return Path(environ.get(CACHE_ENV) or Path.home() / ".cache" / "mfsdp_kit")


def bytecode_is_kept(environ=None, *, probe: str | None = None) -> bool:
    """Would a Python started with `environ` find or keep the bytecode of `probe` (and so of its neighbours)?
    Bytecode already beside the source counts (an image compiled at build time, then PYTHONDONTWRITEBYTECODE=1):
    it is read even where nothing may be written."""
    environ = os.environ if environ is None else environ
    no_writes = bool(environ.get("PYTHONDONTWRITEBYTECODE"))   # any non-empty value switches writing off
    if environ.get("PYTHONPYCACHEPREFIX"):
        return not no_writes
    spec = importlib.util.find_spec(probe or PROBE_MODULE)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return True   # nothing to compile
    source = Path(spec.origin)
    pycache = source.parent / "__pycache__"
    if (pycache / f"{source.stem}.{sys.implementation.cache_tag}.pyc").is_file():
        return True
    return not no_writes and os.access(pycache if pycache.is_dir() else source.parent, os.W_OK)


def bytecode_env(environ=None, *, probe: str | None = None) -> dict[str, str]:
    """Variables to add to a child process's environment so that it keeps the bytecode it compiles: {} when Python
    already does (or MFSDP_KIT_BYTECODE=0), else writing on and a prefix folder of the kit's
    (root()/pycache, or the PYTHONPYCACHEPREFIX already set)."""
    environ = os.environ if environ is None else environ
    if environ.get(BYTECODE_ENV) == "0" or bytecode_is_kept(environ, probe=probe):
        return {}
    prefix = environ.get("PYTHONPYCACHEPREFIX") or str(root(environ) / "pycache")
    return {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": prefix}
