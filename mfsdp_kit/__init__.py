"""mfsdp_kit: Megatron-FSDP for researchers, one composable step per notebook cell (docs/design.md)."""
from .compat import inductor_cache as _inductor_cache
from .compat import lazy_compile as _lazy_compile

_lazy_compile.install()   # before anything imports megatron: its fusions compile at first use
_inductor_cache.install()   # before anything compiles: one torch.compile cache per forced CPU capability
