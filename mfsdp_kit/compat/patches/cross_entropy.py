"""`compat.apply("cross_entropy", model=, loss=)`: one megatron LanguageModule computes its loss with `loss` (the
kit's `distributed.cross_entropy.language_model_loss`, from the logits in their own dtype; that module says why, and
its `use_in` is the caller), an instance patch. The caller hands the function in: compat imports nothing of the kit.
"""
from __future__ import annotations

from types import MethodType
from typing import Callable

import torch

from ..registry import Patch, record

PATCH = Patch(
    target="megatron.core.models.common.language_module.language_module:LanguageModule.compute_language_model_loss",
    upstream="megatron/core/models/common/language_module/language_module.py:128-167 (without TE the loss is "
             "tensor_parallel.vocab_parallel_cross_entropy: an fp32 copy of the logits, line 167; "
             "tensor_parallel/cross_entropy.py:28), instance patch per model",
    needed_if="loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)")
"""The instance patch `_install` applies (a compat.registry row; tests/compat/test_instance_patches.py)."""


def _install(*, model: torch.nn.Module, loss: Callable) -> None:
    """Make `model` (a megatron LanguageModule, e.g. GPTModel, before any wrapper) compute its loss with `loss`
    (`loss(model, labels [b, s], logits [s, b, vocab / TP])` -> per-token losses [b, s], megatron's
    `compute_language_model_loss` contract). Per instance: other models in the process keep megatron's."""
    model.compute_language_model_loss = MethodType(loss, model)
    record(PATCH)
