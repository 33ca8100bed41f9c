"""The third-party warnings the kit knows are benign in its setting, filtered in one place.

The kit runs megatron without Transformer Engine and Apex by design (torch norms, its own SDPA attention), so
megatron says so at import, once per module that checks, and megatron-bridge once per model it builds; on two
engines that is a screenful of `[stderr:N]` lines with the user's install paths before a notebook's first
output, and it hides the warnings that may matter. `compat.apply("quiet")` silences exactly the rows of `KNOWN`, each
matched by its message and the module that emits it, each with the reason it says nothing here; every other
warning is left as it ships. Nothing is filtered by importing the kit: `compat.apply("startup")` applies
it (runtime.init, an engine's boot, the test harness), before megatron is imported. It lives in compat/,
the kit's one door into megatron's internals: it names their modules and loggers, and tests/compat/test_quiet.py fails
(a canary per row) when upstream stops emitting one, so the row can go.

    from mfsdp_kit.compat.patches import quiet
    for row in quiet.known_warnings():
        print(row)        # what is hidden, from where, and why
"""
from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass

from ..registry import Patch, record


@dataclass(frozen=True)
class KnownWarning:
    """One benign message: where it comes from and why the kit hides it."""

    message: str
    """A regular expression matched against the start of the message (`warnings.filterwarnings`' rule)."""
    module: str
    """The module that emits it: a `warnings.warn` caller's module (a regular expression, matched from its start)
    or, for `via="logging"`, the exact name of the logger that logs it."""
    why: str
    """Why it says nothing to a user of the kit."""
    via: str = "warnings"
    """"warnings" (a `warnings.warn` call of `category`) or "logging" (a logger's warning record)."""
    category: type[Warning] = UserWarning
    """The warning's class (for `via="warnings"`)."""

    def __str__(self) -> str:
        return f"{self.via} from {self.module}: {self.message!r} -- {self.why}"


KNOWN: tuple[KnownWarning, ...] = (
    # megatron/core/models/backends.py:21, gpt/gpt_layer_specs.py:70 and three more spec modules, at import
    KnownWarning(message=r"Apex is not installed\. Falling back to Torch Norm", module=r"megatron\.core\.",
                 why="torch's norms, what it falls back to, are the kit's choice (no Apex, no Transformer Engine)"),
    # megatron/core/extensions/transformer_engine_spec_provider.py:74 and models/backends.py:123, at import
    KnownWarning(message=r"The legacy GroupedMLP will be deprecated", module=r"megatron\.core\.",
                 why="asks for Transformer Engine >= 1.7, which the kit does not use; its MoE layers are "
                     "megatron's SequentialMLP (compat/patches/experts.py)"),
    # megatron/core/optimizer/__init__.py:24, optimizer.py:28, clip_grads.py:29 and megatron_fsdp's
    # mixed_precision.py:114, at import
    KnownWarning(message=r"Transformer Engine and Apex are not installed\. Falling back to",
                 module=r"megatron\.core\.|megatron_fsdp\.",
                 why="torch's optimizers and megatron's local multi-tensor kernels are the kit's choice (compat/"
                     "grad_norm.py keeps the grad norm free of host syncs)"),
    # megatron/core/transformer/mlp.py:96 (DeprecationWarning, reported at spec_utils.py:119's build_module): every
    # dense MLP megatron's own layer specs build, which pass no ffn_hidden_size (megatron-core 0.16.1)
    KnownWarning(message=r"MLP requires ffn_hidden_size, but it was not provided",
                 module=r"megatron\.core\.transformer\.spec_utils", category=DeprecationWarning,
                 why="megatron's layer specs build the dense MLP without it and fall back to config.ffn_hidden_size, "
                     "which the kit's configs set; shown wherever DeprecationWarnings are (an engine, a kernel)"),
    # megatron/core/optimizer/optimizer.py:66 `hasattr(param, "grad")`, from distrib_optimizer.py:2290's zero_grad,
    # which upstream marks "throws grad-access warning" (a DDP model with the distributed optimizer)
    KnownWarning(message=r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
                 module=r"megatron\.core\.optimizer\.optimizer",
                 why="megatron's DistributedOptimizer zeroes its fp32 shard views, which never hold a .grad (the "
                     "gradients are in its main_grad buffers)"),
    # megatron/core/transformer/transformer_config.py:1705: the config's default cuda_graph_scope is "full"
    KnownWarning(message=r"full scope is deprecated", module=r"megatron\.core\.transformer\.transformer_config",
                 why="raised by the default value of cuda_graph_scope; the kit captures no megatron CUDA graphs"),
    # torch/distributed/distributed_c10d.py's @deprecated names (torch 2.13), reported from c10d_logger.py:83;
    # called by megatron_fsdp/param_and_grad_buffer.py:2894,2926 (megatron-core 0.16.1)
    KnownWarning(message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
                 module=r"torch\.distributed\.", category=FutureWarning,
                 why="Megatron-FSDP's own collectives call the old names; the kit calls neither"),
    # transformers/configuration_utils.py:430 (logger.warning_once), through megatron-bridge 0.3.1's
    # models/conversion/model_bridge.py:1026 `config.torch_dtype`
    KnownWarning(message=r"`torch_dtype` is deprecated", module="transformers.configuration_utils", via="logging",
                 why="megatron-bridge reads the old attribute name; the kit sets no torch_dtype"),
    # megatron/bridge/utils/fusions.py:46, once per model a provider builds (each rank, each model)
    KnownWarning(message=r"gradient_accumulation_fusion requires FusedLayerNorm", via="logging",
                 module="megatron.bridge.utils.fusions",
                 why="the fused weight-gradient kernel is Apex's; without Apex the kit turns the fusion off"),
)
"""Every filter the kit installs, one row per message."""


PATCH = Patch(target="warnings", needed_if=lambda: apex_note_still_emitted(),
              upstream="megatron/core/models/backends.py:21 and the other emitters each row of KNOWN cites; "
                       "python's warnings filters and the named loggers' filters, process-wide")
"""The registry row of the filters (tests/compat/test_quiet.py holds a canary per row of KNOWN)."""


def apex_note_still_emitted() -> bool:
    """True while megatron's backends still warn that Apex is missing (KNOWN's first row)."""
    from ..registry import upstream_source
    return "Apex is not installed. Falling back to Torch Norm" in upstream_source("megatron.core.models.backends")


class _Drop(logging.Filter):
    """Drops a logger's records whose message starts with one of `patterns`."""

    def __init__(self, patterns: list[str]):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


_installed = False


def _install() -> None:
    """Filter every row of `KNOWN` in this process (idempotent)."""
    global _installed
    if _installed:
        return
    by_logger: dict[str, list[str]] = {}
    for row in KNOWN:
        if row.via == "warnings":
            warnings.filterwarnings("ignore", message=row.message, category=row.category, module=row.module)
        else:
            by_logger.setdefault(row.module, []).append(row.message)
    for name, patterns in by_logger.items():   # on the emitting logger: before any handler, whoever configured them
        logging.getLogger(name).addFilter(_Drop(patterns))
    _installed = True
    record(PATCH)


def known_warnings() -> list[KnownWarning]:
    """What `compat.apply("quiet")` hides, where each comes from and why: print them to see them all."""
    return list(KNOWN)
