"""CPU (gloo) support for megatron-core 0.16.1 DDP, Megatron-FSDP and the distributed optimizer.

Megatron assumes CUDA in a few dozen places: streams, events, `torch.cuda.current_device()`
as the device of new buffers, CUDA RNG state, and string checks such as
`param.type() == 'torch.cuda.FloatTensor'`. On a CPU-only build this module makes those
sites work *inside megatron's own modules only*; torch itself is never modified:

1. `torch` proxy: in each module listed in `PROXY_MODULES`, the module-global name `torch`
   becomes a proxy that forwards everything to torch except `torch.cuda` (CPU stand-ins for
   streams, events, synchronize, current_device -> cpu, RNG -> the CPU generator), tensor
   factories (a CUDA `device=` becomes cpu) and `torch.device('cuda...')` (-> cpu).
2. Single names a proxy cannot reach: `tensor_parallel.random._lazy_call` (queues forever on
   a CPU build, so the RNG tracker silently did nothing), the adapter's `DeviceMesh`, and
   Megatron-FSDP's `_coalescing_manager` (its parameter all-gathers run synchronously: see
   `_sync_coalescing_manager`).
3. Tensor-method call sites (`x.type()`, `x.cuda()`) in the functions listed in `REWRITES`:
   those functions are recompiled from their own source with the calls routed to helpers
   that answer as CUDA would for a CPU tensor.

`compat.apply("cpu")` is a no-op when CUDA is available. Every patch is a row of `compat.registry` naming
the upstream file:line it works around; `still_needed(patch)` checks the upstream source still has
the problem, and tests/compat/ fails for a patch upstream no longer needs (then delete it).
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import sys
import textwrap
import types
from typing import Callable

import torch as _torch

from .. import registry
from ..registry import Patch

CPU = _torch.device("cpu")


PROXY_MODULES = {
    # module: (upstream file:line, snippet proving the CUDA assumption)
    "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp":
        ("distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py:182,184,361-362", "torch.cuda.Stream()"),
    "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer":
        ("distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:3020,3404,3791 (streams, current_device)",
         "torch.cuda.Stream()"),
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter":
        ("distributed/fsdp/mcore_fsdp_adapter.py:91", "torch.cuda.current_device()"),
    "megatron.core.distributed.param_and_grad_buffer":
        ("distributed/param_and_grad_buffer.py:768,783,800,806", "device=torch.cuda.current_device()"),
    "megatron.core.optimizer.optimizer":
        ("optimizer/optimizer.py:473-485", "device='cuda'"),
    "megatron.core.optimizer.distrib_optimizer":
        ("optimizer/distrib_optimizer.py:791", "device=torch.cuda.current_device()"),
    "megatron.core.optimizer.clip_grads":
        ("optimizer/clip_grads.py:90,103,115,174,207 (norm buffers on cuda)", "device='cuda'"),
    "megatron.core.utils":
        ("utils.py:631 (GlobalMemoryBuffer)", "device=torch.cuda.current_device()"),
    "megatron.core.tensor_parallel.random":
        ("tensor_parallel/random.py:55,88-106,235-238 (CUDA RNG)", "torch.cuda.get_rng_state()"),
    "megatron.core.tensor_parallel.mappings":
        ("tensor_parallel/mappings.py:91,141,148,181,442 (TP gather buffers)", "device=torch.cuda.current_device()"),
    "megatron.core.transformer.utils":
        ("transformer/utils.py:35 (default causal mask on cuda)", 'device="cuda"'),
    "megatron.core.pipeline_parallel.schedules":
        ("pipeline_parallel/schedules.py:596,983,2138 (token counters on cuda)", 'device="cuda"'),
    "megatron.core.models.common.embeddings.rotary_pos_embedding":
        ("models/common/embeddings/rotary_pos_embedding.py:162", "torch.cuda.current_device()"),
    # megatron-core's MoE layer (HF MoE families and models.gpt MoE specs):
    "megatron.core.transformer.moe.token_dispatcher":
        ("transformer/moe/token_dispatcher.py:445 (alltoall dispatcher creates a "
         "torch.cuda.Stream at construction)", "torch.cuda.Stream()"),
    "megatron.core.transformer.moe.router":
        ("transformer/moe/router.py:90-92,169-198 (router weight and aux-loss tensors on "
         "torch.cuda.current_device())", "torch.cuda.current_device()"),
    "megatron.core.transformer.moe.moe_utils":
        ("transformer/moe/moe_utils.py:998 (aux-loss tracker tensors on device='cuda')",
         'device="cuda"'),
    "megatron.core.transformer.moe.shared_experts":
        ("transformer/moe/shared_experts.py:123 (overlapped shared experts on a torch.cuda.Stream)",
         "torch.cuda.Stream()"),
    "megatron.core.transformer.moe.experts":
        ("transformer/moe/experts.py:184-192 (expert weights on torch.cuda.current_device())",
         "torch.cuda.current_device()"),
}

REWRITES = {
    # (module, function): (upstream file:line, snippet)
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._build_model_and_main_param_groups"):
        ("optimizer/distrib_optimizer.py:361,420", "model_param.type() =="),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"):
        ("optimizer/clip_grads.py:167", "param.grad.type() =="),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"):
        ("optimizer/optimizer.py:671,690", "param.type() =="),
    ("megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor", "validate_uneven_dtensor"):
        ("distributed/fsdp/src/megatron_fsdp/uneven_dtensor.py:183", ".cuda()"),
}

PATCHES: list[Patch] = registry.ACTIVE  # what compat.apply("cpu") (and compat.patches.bridge) changed, in order
_enabled = False


# ---------------------------------------------------------------- device remapping
def _is_cuda(dev) -> bool:
    if isinstance(dev, bool):
        return False
    if isinstance(dev, int):
        return True
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, _torch.device) and dev.type == "cuda"


class _DeviceMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, _torch.device)

    def __call__(cls, *args, **kwargs):
        if (args and isinstance(args[0], str) and args[0].startswith("cuda")) or kwargs.get("type") == "cuda":
            return CPU
        if args and isinstance(args[0], _torch.device) and args[0].type == "cuda":
            return CPU
        return _torch.device(*args, **kwargs)


class _Device(metaclass=_DeviceMeta):
    """`torch.device` inside patched modules: a CUDA device becomes the CPU."""


# ---------------------------------------------------------------- torch.cuda stand-ins
class _Event:
    def __init__(self, *a, **k): pass
    def record(self, *a, **k): pass
    def wait(self, *a, **k): pass
    def synchronize(self): pass
    def query(self): return True
    def elapsed_time(self, other): return 0.0


class _Stream:
    def __init__(self, *a, **k): pass
    def wait_stream(self, *a, **k): pass
    def wait_event(self, *a, **k): pass
    def record_event(self, event=None): return event or _Event()
    def synchronize(self): pass
    def query(self): return True
    def __enter__(self): return self
    def __exit__(self, *a): return False


_STREAM = _Stream()


class _AnyIndex:
    def __init__(self, value): self.value = value
    def __getitem__(self, index): return self.value
    def __len__(self): return 1


class _CudaNamespace:
    """What `torch.cuda` means inside a patched megatron module on a CPU-only build."""

    Stream, Event = _Stream, _Event
    default_generators = _AnyIndex(_torch.default_generator)  # indexed by "the current device"
    current_stream = default_stream = staticmethod(lambda *a, **k: _STREAM)
    stream = staticmethod(lambda s=None: contextlib.nullcontext())
    synchronize = empty_cache = set_device = staticmethod(lambda *a, **k: None)
    current_device = staticmethod(lambda: CPU)
    is_current_stream_capturing = staticmethod(lambda: False)
    memory_allocated = memory_reserved = max_memory_allocated = staticmethod(lambda *a, **k: 0)
    get_rng_state = staticmethod(lambda device=None: _torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, device=None: _torch.set_rng_state(state))
    manual_seed = manual_seed_all = staticmethod(lambda seed: _torch.manual_seed(seed))
    random = types.SimpleNamespace(get_rng_state=get_rng_state, set_rng_state=set_rng_state)

    def __getattr__(self, name):  # everything else: the real torch.cuda
        return getattr(_torch.cuda, name)


_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "empty_strided",
              "as_tensor", "empty_like", "zeros_like", "ones_like", "full_like", "linspace", "eye")


def _cpu_factory(fn: Callable) -> Callable:
    def factory(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = CPU
        return fn(*args, **kwargs)
    factory.__name__, factory.__wrapped__ = fn.__name__, fn
    return factory


class _TorchProxy(types.ModuleType):
    """The module-global `torch` of patched megatron modules."""

    def __init__(self):
        super().__init__("torch")
        self.__dict__.update(cuda=_CudaNamespace(), device=_Device)
        self.__dict__.update({name: _cpu_factory(getattr(_torch, name)) for name in _FACTORIES})

    def __getattr__(self, name):
        return getattr(_torch, name)


TORCH_PROXY = _TorchProxy()


# ---------------------------------------------------------------- tensor-method call sites
def as_cuda_type(x) -> str:
    """`x.type()` as a CUDA build would answer for the same tensor on the GPU."""
    name = x.type()
    if isinstance(x, _torch.Tensor) and x.device.type == "cpu" and name.startswith("torch.") \
            and not name.startswith("torch.cuda."):
        return "torch.cuda." + name[len("torch."):]
    return name


def _stay_on_cpu(x, *args, **kwargs):
    return x if isinstance(x, _torch.Tensor) else x.cuda(*args, **kwargs)


class _TensorCallRewriter(ast.NodeTransformer):
    """`x.type()` -> `as_cuda_type(x)`, `x.cuda(...)` -> `_stay_on_cpu(x, ...)`."""

    def __init__(self):
        self.count = 0

    def visit_Call(self, node):
        self.generic_visit(node)
        f = node.func
        if isinstance(f, ast.Attribute) and not node.keywords and (
                (f.attr == "type" and not node.args) or f.attr == "cuda"):
            self.count += 1
            helper = "as_cuda_type" if f.attr == "type" else "_stay_on_cpu"
            return ast.copy_location(ast.Call(ast.Name(helper, ast.Load()), [f.value, *node.args], []), node)
        return node


def _resolve(module, qualname: str):
    owner = module
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _recompile(module, qualname: str) -> None:
    """Recompile `module.qualname` from its source with tensor-method calls rewritten."""
    owner, name = _resolve(module, qualname)
    raw = inspect.getattr_static(owner, name)
    func = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    fdef = tree.body[0]
    fdef.decorator_list = []
    rewriter = _TensorCallRewriter()
    rewriter.visit(fdef)
    # A factory gives the new function a `__class__` cell, so zero-argument super() works.
    factory = ast.parse(f"def _factory(__class__):\n    pass\n    return {name}").body[0]
    factory.body[0] = fdef
    tree.body = [factory]
    ast.fix_missing_locations(tree)
    ast.increment_lineno(tree, func.__code__.co_firstlineno - 1)
    module.as_cuda_type, module._stay_on_cpu = as_cuda_type, _stay_on_cpu
    namespace: dict = {}
    exec(compile(tree, inspect.getsourcefile(func), "exec"), module.__dict__, namespace)
    new = namespace["_factory"](owner if isinstance(owner, type) else None)
    new.__qualname__, new.__doc__, new.__wrapped__ = func.__qualname__, func.__doc__, func
    new.__defaults__, new.__kwdefaults__ = func.__defaults__, func.__kwdefaults__
    setattr(owner, name, type(raw)(new) if isinstance(raw, (staticmethod, classmethod)) else new)
    if owner is module:  # rebind `from x import f` copies held by other megatron modules
        for other in list(sys.modules.values()):
            if other is not None and other is not module and getattr(other, "__name__", "").startswith("megatron"):
                for key, value in list(vars(other).items()):
                    if value is func:
                        setattr(other, key, new)


# ---------------------------------------------------------------- enable / inspect
def _record(target: str, upstream: str, needed_if: str) -> None:
    package = "megatron-bridge" if target.startswith("megatron.bridge") else "megatron-core"
    root = "" if upstream.startswith("megatron/") else "megatron/core/"
    registry.record(Patch(target=target, upstream=root + upstream, needed_if=needed_if, package=package))


def proxy_module(name: str, *, upstream: str, needed_if: str) -> None:
    """Give megatron module `name` the CPU `torch` proxy (also used for Megatron-Bridge modules)."""
    module = importlib.import_module(name)
    if module.__dict__.get("torch") is _torch:
        module.torch = TORCH_PROXY
    _record(name, upstream, needed_if)


def _enable() -> bool:
    """Apply every CPU patch once. Returns False (and does nothing) when CUDA is available."""
    global _enabled
    if _enabled or _torch.cuda.is_available():
        return False
    for name, (upstream, snippet) in PROXY_MODULES.items():
        proxy_module(name, upstream=upstream, needed_if=snippet)

    import megatron.core.tensor_parallel.random as tp_random
    tp_random._lazy_call = lambda callback, **kwargs: callback()
    _record("megatron.core.tensor_parallel.random:_lazy_call", "tensor_parallel/random.py:12 (_lazy_call queues "
            "forever on a CPU build)", "from torch.cuda import _lazy_call")

    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter
    adapter.DeviceMesh = _CpuDeviceMesh()
    _record("megatron.core.distributed.fsdp.mcore_fsdp_adapter:DeviceMesh",
            "distributed/fsdp/mcore_fsdp_adapter.py:251,265,276", 'device_type="cuda"')

    import megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer as fsdp_buffer
    fsdp_buffer._coalescing_manager = _sync_coalescing_manager
    _record("megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer:_coalescing_manager",
            "distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:3607-3608 (async all-gathers ordered by "
            "CUDA streams)", "dp_group, async_ops=async_param_gather")

    for (name, qualname), (upstream, snippet) in REWRITES.items():
        _recompile(importlib.import_module(name), qualname)
        _record(f"{name}:{qualname}", upstream, snippet)
    _moe_splits_as_numpy()
    _enabled = True
    return True


def _moe_splits_as_numpy() -> None:
    """Expert parallelism's all-to-all split sizes reach `all_to_all_single` as lists of ints on CPU too.

    The alltoall token dispatcher hands its split sizes (tensors) through `maybe_move_tensor_to_cpu(...,
    as_numpy=True)`, which converts only CUDA tensors (moe_utils.py:1093-1096); a CPU tensor stays
    a tensor, and torch's all_to_all_single binding refuses it (TypeError at EP > 1)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and _torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)
    maybe_move_tensor_to_cpu.__wrapped__ = original
    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    _record("megatron.core.transformer.moe.moe_utils:maybe_move_tensor_to_cpu",
            "transformer/moe/moe_utils.py:1093-1096, transformer/moe/token_dispatcher.py:879-887,667",
            "if torch.is_tensor(tensor) and tensor.is_cuda:")


@contextlib.contextmanager
def _sync_coalescing_manager(group=None, device=None, async_ops: bool = False):
    """Megatron-FSDP's `_coalescing_manager` on CPU: the coalesced collectives finish before the
    block exits, whatever `async_ops` asks; the yielded manager holds no work, so its `wait()`
    returns at once.

    Megatron-FSDP prefetches parameter all-gathers asynchronously and orders buffer reuse with
    CUDA streams and events, which are no-ops here: an all-gather still running in gloo's thread
    could then write into bucket memory the main thread has freed. In-flight gathers crashed
    about one in four 2-rank CPU runs of ~100 steps (SIGSEGV / SIGABRT in a rank); synchronous
    ones cost nothing on CPU, where there is no compute to overlap with."""
    import torch.distributed.distributed_c10d as c10d
    with c10d._coalescing_manager(group, device, async_ops=False) as cm:
        yield cm


class _CpuDeviceMesh:
    """The adapter's `DeviceMesh`: `from_group(..., device_type="cuda")` builds a CPU mesh."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        from torch.distributed.device_mesh import DeviceMesh
        return DeviceMesh.from_group(group, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    def __getattr__(self, name):
        from torch.distributed.device_mesh import DeviceMesh
        return getattr(DeviceMesh, name)


def still_needed(patch: Patch) -> bool:
    """True while upstream's source still holds the CUDA assumption the patch works around."""
    return patch.still_needed()


def describe() -> str:
    """One line per active patch: target, then the upstream file:line it works around."""
    return registry.describe()
