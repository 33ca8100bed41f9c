"""mfsdp_kit: Megatron-FSDP for researchers, one composable step per notebook cell (docs/design.md)."""
from .compat import inductor_cache as _inductor_cache
from .compat import lazy_compile as _lazy_compile
from .compat import lazy_cpp_extension as _lazy_cpp_extension

_lazy_compile.install()   # before anything imports megatron: its fusions compile at first use
_lazy_cpp_extension.install()   # and its NCCL allocator imports torch.utils.cpp_extension when it is built
_inductor_cache.install()   # before anything compiles: one torch.compile cache per forced CPU capability
