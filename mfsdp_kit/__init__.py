"""mfsdp_kit: Megatron-FSDP for researchers, one composable step per notebook cell (docs/design.md).

Importing the kit changes nothing in torch or megatron: its patches are installed by `runtime.init` (process-wide
ones: `compat.apply("startup")`) or where a feature is first used (`compat.registry` lists what is active).

The modules live in subpackages named for their role (docs/design.md, "Package layout"). The short names the
notebooks type, `from mfsdp_kit import cluster, engine, runtime, ...`, are `SHORT_NAMES`: each imports its module
on first use (PEP 562), so `import mfsdp_kit` itself still imports nothing of the kit, torch or megatron.
"""
import importlib

SHORT_NAMES = {
    "adapters": "mfsdp_kit.lora.adapters",
    "chat": "mfsdp_kit.train.chat",
    "cluster": "mfsdp_kit.notebook.cluster",
    "data": "mfsdp_kit.train.data",
    "engine": "mfsdp_kit.distributed.engine",
    "generate": "mfsdp_kit.train.generate",
    "gpus": "mfsdp_kit.notebook.gpus",
    "notebook_model": "mfsdp_kit.notebook.model",
    "packing": "mfsdp_kit.train.packing",
    "plots": "mfsdp_kit.notebook.plots",
    "runtime": "mfsdp_kit.distributed.runtime",
    "sync": "mfsdp_kit.weights.sync",
    "widgets": "mfsdp_kit.notebook.widgets",
}
"""`mfsdp_kit.<name>` -> the module it stands for (the names the notebooks and README import from the root)."""


def __getattr__(name: str):
    if name in SHORT_NAMES:
        module = importlib.import_module(SHORT_NAMES[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'mfsdp_kit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *SHORT_NAMES})
