"""The CPU patches: which are active, that each is still needed, and that torch is untouched."""
import pytest
import torch

from mfsdp_kit import compat
from mfsdp_kit.compat.patches import cpu, no_te

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU compat is off when CUDA is present")


@pytest.fixture(scope="module")
def patches():
    real = (torch.cuda.Stream, torch.cuda.Event, torch.empty, torch.Tensor.type, torch.Tensor.cuda, torch.device)
    compat.apply("cpu")
    yield cpu.PATCHES
    assert (torch.cuda.Stream, torch.cuda.Event, torch.empty, torch.Tensor.type, torch.Tensor.cuda,
            torch.device) == real, "a CPU patch leaked into torch itself"


def test_patches_listed(patches):
    print("\n" + cpu.describe())
    targets = {p.target for p in patches}  # compat.patches.bridge may add its own (megatron.bridge.*) entries
    expected = set(cpu.PROXY_MODULES) | {f"{m}:{f}" for m, f in cpu.REWRITES} | {
        "megatron.core.tensor_parallel.random:_lazy_call", "megatron.core.distributed.fsdp.mcore_fsdp_adapter:DeviceMesh"}
    assert expected <= targets
    assert all(p.upstream for p in patches)


def test_each_patch_still_needed(patches):
    """Fails once upstream drops the CUDA assumption: then delete that patch."""
    stale = [p.target for p in patches if not cpu.still_needed(p)]
    assert stale == []


def test_torch_is_not_patched_globally(patches):
    assert torch.zeros(1).type() == "torch.FloatTensor"
    assert torch.device("cuda").type == "cuda"
    with pytest.raises((RuntimeError, AssertionError, AttributeError)):
        torch.cuda.current_stream()


def test_proxy_routes_cuda_to_cpu(patches):
    import megatron.core.utils as mu
    assert mu.torch.cuda.current_device() == torch.device("cpu")
    assert mu.torch.empty(2, device="cuda").device.type == "cpu"
    assert cpu.as_cuda_type(torch.zeros(1)) == "torch.cuda.FloatTensor"


def test_no_te_placeholder_still_needed():
    compat.apply("no_te")
    assert no_te.still_needed(), "megatron-core now guards TELinear: delete compat/patches/no_te.py"


def test_every_active_patch_is_still_needed_and_written_for_this_version(patches):
    """One registry for cpu, no_te and bridge rows: each still needed, each package at the version its
    file:line references were checked against (a new megatron: re-check them, then bump WRITTEN_FOR)."""
    from mfsdp_kit.compat.patches import bridge
    from mfsdp_kit.compat import registry
    compat.apply("no_te")
    compat.apply("bridge")
    packages = {p.package for p in registry.ACTIVE}
    print("\n" + registry.describe())
    assert packages == {"megatron-core", "megatron-bridge"}
    assert [p.target for p in registry.ACTIVE if not p.still_needed()] == []
    assert registry.version_mismatches() == {}


def test_a_snippet_upstream_no_longer_has_is_reported_as_not_needed():
    from mfsdp_kit.compat.registry import Patch
    real = Patch(target="megatron.core.utils", upstream="utils.py", needed_if="class GlobalMemoryBuffer")
    fixed = Patch(target="megatron.core.utils", upstream="utils.py", needed_if="this text is not in utils.py")
    assert real.still_needed() and not fixed.still_needed()
