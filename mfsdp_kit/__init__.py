"""mfsdp_kit: Megatron-FSDP for researchers, one composable step per notebook cell (docs/design.md)."""
from .compat import lazy_compile as _lazy_compile

_lazy_compile.install()   # before anything imports megatron: its fusions compile at first use
