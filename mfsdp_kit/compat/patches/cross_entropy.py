"""`compat.apply("cross_entropy", model=)`: one megatron LanguageModule computes its loss with the kit's
`models.cross_entropy` (from the logits in their own dtype; that module says why), an instance patch.
"""
from __future__ import annotations

from types import MethodType

import torch

from ..registry import Patch, record

PATCH = Patch(
    target="megatron.core.models.common.language_module.language_module:LanguageModule.compute_language_model_loss",
    upstream="megatron/core/models/common/language_module/language_module.py:128-167 (without TE the loss is "
             "tensor_parallel.vocab_parallel_cross_entropy: an fp32 copy of the logits, line 167; "
             "tensor_parallel/cross_entropy.py:28), instance patch per model",
    needed_if="loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)")
"""The instance patch `_install` applies (a compat.registry row; tests/compat/test_instance_patches.py)."""


def _install(*, model: torch.nn.Module) -> None:
    """Make `model` (a megatron LanguageModule, e.g. GPTModel, before any wrapper) compute its loss with
    `cross_entropy`. Per instance: other models in the process keep megatron's."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from ...models.cross_entropy import language_model_loss
    from ...config import ConfigError
    if not isinstance(model, LanguageModule):
        raise ConfigError(f"fused_cross_entropy=True needs a megatron LanguageModule (GPTModel, ...), got "
                          f"{type(model).__name__}; allowed: False for other models")
    model.compute_language_model_loss = MethodType(language_model_loss, model)
    record(PATCH)
