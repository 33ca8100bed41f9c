"""compat.patches.lazy_compile: importing megatron through the kit does not import torch's compiler, and a
fused function compiles (once) at its first call, giving what the function computes."""
import subprocess
import sys

import torch

from mfsdp_kit.compat.patches import lazy_compile

PROBE = """
import sys, torch
from mfsdp_kit import compat; compat.apply("startup")  # what runtime.init does first
import mfsdp_kit, megatron.core, mfsdp_kit.distributed.engine, mfsdp_kit.models.hf
import megatron.core.jit as jit
from mfsdp_kit.compat.patches import lazy_compile
from mfsdp_kit.compat import registry
print(int("torch._dynamo" in sys.modules), int(jit.jit_fuser is torch.compile),
      int(lazy_compile.PATCH in registry.ACTIVE), int(lazy_compile.PATCH.still_needed()))
"""


def test_importing_megatron_through_the_kit_leaves_the_compiler_unimported():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    dynamo, eager_fuser, recorded, needed = map(int, out[-4:])
    assert not dynamo and not eager_fuser and recorded
    assert needed, "megatron.core.jit no longer sets jit_fuser = torch.compile: delete compat/patches/lazy_compile.py"


def test_lazy_compiles_once_at_the_first_call_with_the_options():
    calls = []

    def compile_fn(fn, **options):   # stands in for torch.compile: records, returns the function
        calls.append(options)
        return fn

    @lazy_compile.lazy(compile_fn)
    def plain(x):
        return x * 2

    @lazy_compile.lazy(compile_fn)(dynamic=False)
    def with_options(x):
        return x + 1

    assert calls == [] and plain.__name__ == "plain"
    x = torch.arange(3.0)
    assert torch.equal(plain(x), x * 2) and torch.equal(plain(x), x * 2)
    assert torch.equal(with_options(x), x + 1)
    assert calls == [{}, {"dynamic": False}]


def test_a_fusion_that_calls_another_compiles_with_symbolic_tokens():
    """megatron's `bias_swiglu` (a jit_fuser function) calls `swiglu` (another): the inner one, reached while dynamo
    traces the outer, is inlined instead of marking its input dynamic (a call dynamo refuses to trace). Same values
    as megatron's math in eager, for two token counts."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    from torch._dynamo.utils import counters
    g = torch.Generator().manual_seed(0)
    bias = torch.randn(16, generator=g)
    before = counters["stats"]["unique_graphs"]
    for tokens in (7, 5, 3):
        y = torch.randn(tokens, 1, 16, generator=g, requires_grad=True)
        out = bias_swiglu_impl(y, bias)
        gate, up = (y + bias).chunk(2, -1)
        torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up)
        out.sum().backward()
    # one graph for bias_swiglu and one for bias_swiglu_back, whatever the token count: no recompile
    assert counters["stats"]["unique_graphs"] - before <= 2, counters["stats"]["unique_graphs"] - before
