"""`compat.apply("critic_values", model=)`: a GPTModel with rl.critic's value head returns the head's output as its
per-token "loss", an instance patch of `compute_language_model_loss` (rl/critic.py says why).
"""
from __future__ import annotations

from types import MethodType

import torch

from ..registry import Patch, record

PATCH = Patch(
    target="megatron.core.models.gpt.gpt_model:GPTModel._postprocess",
    upstream="megatron/core/models/gpt/gpt_model.py:685-714 (the output layer's logits [s, b, V], then the "
             "per-token loss from compute_language_model_loss when labels are given), instance patch per model",
    needed_if="loss = self.compute_language_model_loss(labels, logits)")
"""What `value_model` relies on: the per-token output of a chunk given labels is `compute_language_model_loss`'s
(a compat.registry row; tests/compat/test_instance_patches.py fails when upstream changes those lines)."""


def _values_as_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """In place of `compute_language_model_loss`: the head's output [s, b, 1] as the per-token "loss" [b, s]."""
    return logits[..., 0].transpose(0, 1).float().contiguous()


def _install(*, model) -> None:
    """Make `model.compute_language_model_loss` return the value head's output (idempotent per model)."""
    model.compute_language_model_loss = MethodType(_values_as_loss, model)
    record(PATCH)
