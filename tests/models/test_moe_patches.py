"""Canaries for the MoE patches in compat.patches.bridge, compat.patches.experts and compat.patches.fsdp_grads: each is
registered and still needed; when upstream fixes one, its test fails and the patch can be deleted."""
from mfsdp_kit import compat
from mfsdp_kit.compat.patches import bridge
from mfsdp_kit.compat import registry
from mfsdp_kit.models import archs, hf as hf_models


def test_moe_patches_are_registered_and_still_needed():
    olmoe = archs.ARCHS["OlmoeForCausalLM"]
    hf_models.fix_bridge(olmoe)   # what loading an OLMoE folder applies: its spec's bridge mappings
    targets = {p.target: p for p in registry.ACTIVE}
    for target in ("megatron.bridge.models.olmoe.olmoe_bridge:OlMoEBridge.mapping_registry",
                   "megatron.bridge.models.conversion.param_mapping:MegatronParamMapping.gather_from_ep_ranks"):
        assert targets[target].still_needed(), target
    assert bridge.mappings_still_needed(olmoe.architecture,
                                        tuple(kwargs["megatron_param"] for _, kwargs in olmoe.bridge.mappings))


def test_moe_utils_names_defined_without_te():
    compat.apply("bridge")
    from megatron.core.transformer.moe import moe_utils
    if not moe_utils.HAVE_TE:
        assert bridge.moe_names_still_undefined()  # upstream's except-branch still leaves them undefined
        assert all(getattr(moe_utils, n) is None for n in bridge.MOE_TE_NAMES)


def test_expert_parallel_patches_are_registered_and_still_needed():
    """SequentialMLP expert numbering (compat.patches.experts) and one-rank FSDP groups' gradients (compat.patches.fsdp_grads)."""
    from mfsdp_kit.compat.patches import experts, fsdp_grads
    compat.apply("bridge")
    compat.apply("fsdp_grads")
    targets = {p.target: p for p in registry.ACTIVE}
    for target in ("megatron.bridge.models.conversion.model_bridge:_megatron_local_name_to_global",
                   fsdp_grads.TARGET):
        assert targets[target].still_needed(), target
    assert experts.global_names_still_needed() and fsdp_grads.still_needed()

