"""What Megatron-Bridge 0.3.1 needs to import and convert correctly without Transformer Engine.

1. Import placeholders. `megatron/bridge/peft/lora_layers.py:20` and `peft/lora.py:21` import
   `transformer_engine.pytorch` unconditionally (LoRA, which the kit does not use), and
   `megatron/core/ssm/mamba_mixer.py` reaches `triton` at import time through the Mamba provider.
   While `megatron.bridge` is imported, placeholder modules stand in for whichever of the two is
   not installed; they are removed from `sys.modules` right after, so nothing imported later
   sees them, and they never shadow a real install. Placeholder classes raise if instantiated.
2. MoE without TE. `megatron/core/transformer/moe/moe_utils.py:24-38` imports TE's MoE kernels
   in a try block whose `except ImportError` leaves `te_general_gemm` (and the fused_* names)
   undefined, and :1192 then tests `te_general_gemm is not None`: a NameError in every router
   forward. The names are defined as None, which is what the code tests for.
   Expert numbering of the SequentialMLP names under expert parallelism is `compat.patches.experts`.
3. TP scatter. `models/conversion/param_mapping.py:502` scatters non-contiguous TP splits
   (row-parallel weights split along dim 1); gloo's scatter mishandles them (logits were off
   by 0.56 at TP=2). The splits are made contiguous first.
4. A load's progress bar. `models/conversion/model_bridge.py:760` wraps every HF -> Megatron load
   in a rich Progress, and `load_weights_hf_to_megatron` has no `show_progress` to turn it off (the
   export has one; the kit passes False). On a notebook engine rich draws an ipywidgets Output that
   never updates: a bar left at "0% (0/17) Qwen2Bridge" and empty `[output:N]` blocks under every
   %px cell that loads a model. The load runs with show_progress=False.
5. Mappings a bridge lacks (`compat.apply("bridge_mappings", architecture=, mappings=)`): some bridges map only TE's
   module names (OLMoE's maps only TE's grouped experts, `mlp.experts.linear_fc1.weight<i>`, not the local spec's
   SequentialMLP `mlp.experts.local_experts.<i>.linear_fc1.weight`). Which mappings an architecture lacks is the
   caller's to say (the kit's `models.archs` spec of the family, `Bridge.mappings`); this module adds them to that
   architecture's bridge class, once a process, with a registry row whose canary fails when upstream maps them.
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import functools
import inspect
import sys
import types

from .. import registry
from ..access import bridge_model

PLACEHOLDER = "__mfsdp_kit_placeholder__"


class _Missing:
    """A class from a package that is not installed: using it says so."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__module__}.{type(self).__name__} is a placeholder: "
                           "the package is not installed (mfsdp_kit.compat.patches.bridge)")


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _module(f"{self.__name__}.{name}") if name[:1].islower() else \
            type(name, (_Missing,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


def _module(name: str) -> types.ModuleType:
    module = _PlaceholderModule(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []
    setattr(module, PLACEHOLDER, True)
    sys.modules[name] = module
    return module


def _triton_placeholder() -> None:
    triton = _module("triton")
    identity = lambda *a, **k: a[0] if len(a) == 1 and callable(a[0]) and not k else (lambda f: f)  # noqa: E731
    triton.jit = triton.autotune = triton.heuristics = identity
    triton.Config = lambda *a, **k: None
    triton.cdiv = lambda a, b: (a + b - 1) // b
    triton.next_power_of_2 = lambda n: 1 << (int(n) - 1).bit_length()
    triton.language = _module("triton.language")


@contextlib.contextmanager
def placeholders():
    """Placeholders for missing TE / triton while the block runs; removed afterwards."""
    # megatron-core probes for TE first, so its HAVE_TE flags stay False.
    import megatron.core.extensions.transformer_engine  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    added = []
    if importlib.util.find_spec("transformer_engine") is None:
        _module("transformer_engine").pytorch = _module("transformer_engine.pytorch")
        added.append("transformer_engine")
    if importlib.util.find_spec("triton") is None:
        # transformers (imported by the bridge) imports torch's compiler (flex_attention's
        # torch.compiler.disable), which probes for triton: it must see the real absence, not the
        # placeholder (compat.patches.lazy_compile leaves the compiler unimported until here). Where triton is
        # installed (GPU images) there is no placeholder to hide, and the compiler stays unimported:
        # 1.2-1.5 s of every GPU process that loads a model, for a compiler nothing may call.
        import torch._dynamo  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
        _triton_placeholder()
        added.append("triton")
    try:
        yield added
    finally:
        for name in list(sys.modules):
            if name.split(".")[0] in added and getattr(sys.modules[name], PLACEHOLDER, False):
                del sys.modules[name]


def _import_bridge():
    """compat.apply("bridge"): `megatron.bridge` imported (with placeholders only where needed), its fixes applied."""
    if "megatron.bridge" not in sys.modules:
        with placeholders() as added:
            import megatron.bridge  # noqa: F401
            import megatron.bridge.models  # noqa: F401
        if added:
            registry.record(registry.Patch(
                target="megatron.bridge.peft.lora_layers", package="megatron-bridge",
                upstream="megatron/bridge/peft/lora_layers.py:20, peft/lora.py:21 (import TE unconditionally)",
                needed_if=placeholders_still_needed))
    _patch_tp_scatter()
    _patch_load_progress()
    _cpu_patches()
    _moe_without_te()
    return sys.modules["megatron.bridge"]


MOE_TE_NAMES = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                "fused_topk_with_score_function", "fused_unpermute", "te_general_gemm")
"""Names moe_utils imports from TE and leaves undefined without it."""


def _moe_without_te() -> None:
    from ..door import apply
    apply("moe_without_te")
    apply("experts")   # SequentialMLP expert names at any expert-parallel size


def _define_moe_te_names() -> None:
    """compat.apply("moe_without_te"): TE's MoE kernel names in moe_utils defined as None (what its code tests
    for); megatron-core only, so a MoE model built from sizes (models.gpt) needs no megatron.bridge import for it."""
    from megatron.core.transformer.moe import moe_utils
    if not moe_utils.HAVE_TE and moe_names_still_undefined():
        for name in MOE_TE_NAMES:
            setattr(moe_utils, name, None)
        registry.record(registry.Patch(
            target="megatron.core.transformer.moe.moe_utils",
            upstream="megatron/core/transformer/moe/moe_utils.py:24-38,1192 (te_general_gemm undefined without TE)",
            needed_if=moe_names_still_undefined))


def moe_names_still_undefined() -> bool:
    """True while moe_utils' `except ImportError` branch does not define te_general_gemm."""
    from megatron.core.transformer.moe import moe_utils
    source = inspect.getsource(moe_utils)
    branch = source[source.index("except ImportError"):source.index("# MOE logging")]
    return "te_general_gemm" not in branch


def _add_mappings(*, architecture: str, mappings: tuple[tuple[str, dict], ...]) -> bool:
    """compat.apply("bridge_mappings", architecture=, mappings=): the bridge class Megatron-Bridge registered for
    `architecture` (an HF class name) maps `mappings` too, each (mapping class name in the bridge's param_mapping
    module, its keyword arguments), made afresh at every `mapping_registry()` as the bridge makes its own. Once a
    class; returns whether it changed it."""
    from ..door import apply
    apply("bridge")   # megatron.bridge imported the kit's way first
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    pm = bridge_model.param_mapping()
    cls = bridge_model.bridge_class(architecture)
    original = cls.mapping_registry
    if hasattr(original, "__wrapped__"):
        return False

    def mapping_registry(self):
        added = [getattr(pm, kind)(**kwargs) for kind, kwargs in mappings]
        return MegatronMappingRegistry(*original(self).mappings, *added)

    mapping_registry.__wrapped__ = original
    cls.mapping_registry = mapping_registry
    lines, first = inspect.getsourcelines(original)
    names = tuple(kwargs["megatron_param"] for _, kwargs in mappings)
    registry.record(registry.Patch(
        target=f"{cls.__module__}:{cls.__qualname__}.mapping_registry",
        upstream=f"{cls.__module__.replace('.', '/')}.py:{first}-{first + len(lines) - 1} (no mapping of "
                 f"{', '.join(names)})",
        package="megatron-bridge", needed_if=functools.partial(mappings_still_needed, architecture, names)))
    return True


def mappings_still_needed(architecture: str, megatron_params: tuple[str, ...]) -> bool:
    """True while the bridge of `architecture` maps none of `megatron_params` itself (its own mapping_registry's
    source names none of them)."""
    fn = bridge_model.bridge_class(architecture).mapping_registry
    source = inspect.getsource(getattr(fn, "__wrapped__", fn))
    return not any(name in source for name in megatron_params)


BRIDGE_CPU_MODULES = {
    "megatron.bridge.models.conversion.param_mapping":
        ("megatron/bridge/models/conversion/param_mapping.py:986-987 (replicated weights moved to "
         "torch.cuda.current_device() at TP > 1)", "torch.cuda.current_device()"),
}


def _cpu_patches() -> None:
    """On a CPU-only build, the bridge (and MoE) modules that assume CUDA get compat.patches.cpu's torch proxy."""
    import torch
    from . import cpu
    if torch.cuda.is_available() or any(p.target in BRIDGE_CPU_MODULES for p in cpu.PATCHES):
        return
    for name, (upstream, snippet) in BRIDGE_CPU_MODULES.items():
        cpu.proxy_module(name, upstream=upstream, needed_if=snippet)


def _replace_method(cls, name: str, make, patch: registry.Patch) -> None:
    """cls.name := make(original), once per process; the original stays reachable as `__wrapped__`
    (the registry's canary reads its source)."""
    original = getattr(cls, name)
    if getattr(original, "_mfsdp_kit_patch", False):
        return
    replacement = make(original)
    replacement.__wrapped__, replacement._mfsdp_kit_patch = original, True
    setattr(cls, name, replacement)
    registry.record(patch)


def _patch_tp_scatter() -> None:
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping

    def make(original):
        def scatter_to_tp_ranks(self, splits, *args, **kwargs):
            return original(self, [s.contiguous() for s in splits] if splits else splits, *args, **kwargs)
        return scatter_to_tp_ranks

    _replace_method(MegatronParamMapping, "scatter_to_tp_ranks", make, registry.Patch(
        target="megatron.bridge.models.conversion.param_mapping:MegatronParamMapping.scatter_to_tp_ranks",
        upstream="megatron/bridge/models/conversion/param_mapping.py:502 (non-contiguous TP splits)",
        package="megatron-bridge", needed_if=scatter_fix_still_needed))


def _patch_load_progress() -> None:
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

    def make(original):
        def load_weights_hf_to_megatron(self, *args, **kwargs):
            tracking = self._with_progress_tracking
            self._with_progress_tracking = lambda tasks, description, show_progress=True: tracking(tasks, description,
                                                                                                    False)
            try:
                return original(self, *args, **kwargs)
            finally:
                del self._with_progress_tracking   # the class's method again
        return load_weights_hf_to_megatron

    _replace_method(MegatronModelBridge, "load_weights_hf_to_megatron", make, registry.Patch(
        target="megatron.bridge.models.conversion.model_bridge:MegatronModelBridge.load_weights_hf_to_megatron",
        upstream="megatron/bridge/models/conversion/model_bridge.py:760 (a rich bar with no way to turn it off)",
        package="megatron-bridge", needed_if="self._with_progress_tracking(hf_to_megatron_tasks, description)"))


def scatter_fix_still_needed() -> bool:
    """True while upstream scatters the splits without making them contiguous."""
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping
    fn = MegatronParamMapping.scatter_to_tp_ranks
    return ".contiguous()" not in inspect.getsource(getattr(fn, "__wrapped__", fn))


def placeholders_still_needed() -> bool:
    """True while the bridge's LoRA modules import TE unconditionally."""
    spec = importlib.util.find_spec("megatron.bridge.peft.lora_layers")
    source = open(spec.origin).read()
    return "\nimport transformer_engine.pytorch as te" in source
