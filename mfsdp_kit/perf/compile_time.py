"""Seconds spent compiling, so a benchmark can say how much of a first iteration was compile.

Two compilers run in a kit process on a GPU:
  - torch.compile (the decode glue and the fused RoPE/SwiGLU with `kernels="torch"`): dynamo keeps its own count,
    which includes inductor and the Triton kernels it compiles;
  - Triton, for the kit's own kernels (`rl.rollout.kernels`, `models.triton_fusions`), compiled in
    this process at their first launch. Triton tells a listener (`triton.knobs.compilation.listener`, Triton >= 3.4)
    each compile's stage times, and each load from its disk cache. Inductor compiles some of its kernels in this
    process too (on 1 H100, 6 in the torch path's first GRPO iteration): the listener hears those as well, so they
    are counted apart (`other_*`).
Read both before and after a piece of work; the difference is its compile.
"""
from __future__ import annotations

import importlib.util
import threading
from dataclasses import asdict, dataclass, field


_LOCK = threading.Lock()
"""Guards the counts: Triton calls the listener on whichever thread compiled."""


def torch_compile_seconds() -> float:
    """Seconds torch.compile has spent in this process so far (dynamo's own count: tracing, inductor, Triton's
    compile and cache loads for inductor's kernels)."""
    from torch._dynamo.utils import compilation_time_metrics
    return sum(compilation_time_metrics.get("_compile.compile_inner", []))


def kit_kernel(src) -> bool:
    """Whether the source a Triton compilation listener is told of is one of the kit's kernels (its JITFunction's
    module is under `mfsdp_kit`; an IR source has no function)."""
    return str(getattr(getattr(src, "fn", None), "module", "")).startswith("mfsdp_kit.")


@dataclass
class TritonCompiles:
    """What Triton compiled in this process since `listen()`: the kit's own kernels, and apart, any other."""

    seconds: float = 0.0
    """Compile seconds of the kit's kernels, Triton's own stage times (IR, lowering to PTX and cubin, storing in its
    disk cache)."""
    kernels: int = 0
    """The kit's kernels compiled (one per specialisation: dtype, constexprs, integer arguments equal to 1 or
    divisible by 16)."""
    cache_hits: int = 0
    """The kit's kernels loaded from Triton's disk cache instead (TRITON_CACHE_DIR)."""
    other_seconds: float = 0.0
    """Compile seconds of kernels from outside the kit (inductor's, where it compiles in this process)."""
    other_kernels: int = 0
    """Kernels from outside the kit compiled (their disk-cache loads are not counted)."""
    by_name: dict = field(default_factory=dict)
    """The kit's kernels compiled, per kernel name (one count per specialisation)."""

    def listen(self) -> "TritonCompiles":
        """Become Triton's compilation listener (replacing any other); without Triton, or with a Triton that has no
        listener, nothing is counted. Returns self."""
        if importlib.util.find_spec("triton") is None:
            return self
        import triton
        compilation = getattr(getattr(triton, "knobs", None), "compilation", None)
        if compilation is not None and hasattr(compilation, "listener"):
            compilation.listener = self._record
        return self

    def _record(self, *, src, metadata, metadata_group, times, cache_hit: bool) -> None:
        with _LOCK:   # compiles run on the kit's compile threads too (`models.triton_launch`)
            self._count(src, times, cache_hit)

    def _count(self, src, times, cache_hit: bool) -> None:
        fn = getattr(src, "fn", None)   # the JITFunction (an IR source has none)
        kit = kit_kernel(src)
        if cache_hit:
            self.cache_hits += kit
        elif kit:
            self.kernels += 1
            self.seconds += times.total / 1e6   # microseconds
            name = getattr(fn, "__name__", "?")
            self.by_name[name] = self.by_name.get(name, 0) + 1
        else:
            self.other_kernels += 1
            self.other_seconds += times.total / 1e6

    def read(self) -> dict:
        """Every field so far, as a dict: two reads' difference (`since`) is what a piece of work compiled."""
        with _LOCK:
            return asdict(self)

    @staticmethod
    def since(*, before: dict, after: dict) -> dict:
        """What was compiled between two `read()`s: each count's difference (`by_name`: the names that grew)."""
        grown = {k: v - before["by_name"].get(k, 0) for k, v in after["by_name"].items()}
        return {k: {n: c for n, c in grown.items() if c} if k == "by_name" else v - before[k] for k, v in after.items()}
