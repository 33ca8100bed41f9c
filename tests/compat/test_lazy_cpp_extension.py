"""compat.patches.lazy_cpp_extension: importing megatron through the kit leaves torch.utils.cpp_extension (and
setuptools) unimported; the one function of each module that needs it still works, and nothing else in
those modules reads the deferred names (when upstream adds a use, or drops the import, a test fails)."""
import subprocess
import sys

from mfsdp_kit.compat.patches import lazy_cpp_extension

PROBE = """
import sys, types
from mfsdp_kit import compat; compat.apply("startup")  # what runtime.init does first
import mfsdp_kit, megatron.core
from mfsdp_kit.compat.patches import lazy_cpp_extension as lazy
from mfsdp_kit.compat import registry
print("imported", int(lazy.DEFERRED in sys.modules), int("setuptools" in sys.modules))
print("recorded", int(all(d.patch in registry.ACTIVE for d in lazy.TARGETS.values())))
print("needed", int(all(d.patch.still_needed() for d in lazy.TARGETS.values())))

# megatron's own build path, with cpp_extension.load_inline faked as cpp_extension is imported: the upstream
# line `torch.utils.cpp_extension.load_inline(...)` must resolve although nothing imported it at module level
import os
from importlib.abc import MetaPathFinder
from importlib.machinery import PathFinder
import megatron.core.nccl_allocator as na
import megatron.core.inference.unified_memory as um
na.os = types.SimpleNamespace(path=os.path, makedirs=lambda *a, **k: None)   # no build/ in site-packages
calls = []
class Allocator:
    @staticmethod
    def get_nccl_allocator():
        return "fake allocator"
class FakeLoadInline(MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != lazy.DEFERRED:
            return None
        spec = PathFinder.find_spec(fullname, path)
        load = spec.loader.exec_module
        def exec_module(module):
            load(module)
            module.load_inline = lambda **kw: calls.append(kw["name"]) or Allocator
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, FakeLoadInline())
na._build_nccl_allocator()
print("built", int(na._allocator == "fake allocator"), ",".join(calls))
ce = sys.modules[lazy.DEFERRED]
print("names", int(na.cpp_extension is ce), int(um.CUDA_HOME == ce.CUDA_HOME), int(um.load_inline is ce.load_inline))
"""


def test_megatron_imports_without_cpp_extension_and_the_builders_still_find_it():
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE], capture_output=True, text=True, check=True)
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines["imported"] == "0 0", "cpp_extension (or setuptools) imported by `import megatron.core`"
    assert lines["recorded"] == "1"
    assert lines["needed"] == "1", "megatron no longer imports cpp_extension at module level: delete the row"
    assert lines["built"] == "1 nccl_allocator"
    assert lines["names"] == "1 1 1"


def code_objects(code):
    yield code
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            yield from code_objects(const)


def test_only_the_wrapped_function_reads_the_deferred_names():
    """The deferral is safe while each module's one user function (wrapped) is the only code that reads
    what the blanked line bound; a new upstream use elsewhere must fail here, not at a user's call."""
    import importlib.util
    for target, deferral in lazy_cpp_extension.TARGETS.items():
        path = importlib.util.find_spec(target).origin
        source = open(path).read()
        edited = lazy_cpp_extension.without_line(source, deferral.line)
        assert edited is not None and edited.count("\n") == source.count("\n"), target
        readers = {code.co_qualname for code in code_objects(compile(edited, path, "exec"))
                   if set(deferral.names) & set(code.co_names)}
        assert readers == {deferral.user}, (target, readers)
