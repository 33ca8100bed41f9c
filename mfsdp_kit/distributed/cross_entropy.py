"""Cross-entropy from the logits in their own dtype, in compiled kernels (`EngineConfig.kernels.fused_cross_entropy`).

megatron-core's vocab-parallel cross-entropy without Transformer Engine (tensor_parallel/cross_entropy.py)
first copies the [tokens, vocab] logits to fp32, then runs max, subtract, exp, sum and divide over that copy,
one kernel each, keeps the fp32 softmax for backward, scales it in place there, and autograd casts it back to
the logits' dtype. At vocabulary 32768 and 16384 tokens a micro-batch, the copy is 2 GiB, and each pass reads and
writes all of it (kernel times: docs/benchmarks.md, "levers, fourth set"). Its 'native' fusion
(`cross_entropy_loss_fusion`) starts from the same fp32 copy.

Here forward reads the logits twice (the row max; then the sum of exp and the label's logit, one compiled
kernel) and keeps for backward only the logits themselves and one fp32 number per token. Backward is one
compiled kernel that writes (softmax - one_hot) x the loss gradient, straight in the logits' dtype. The math is
megatron's: fp32 accumulation, the row max subtracted before exp, loss = log(sum exp) - (label logit - max).
Only the rounding differs: one rounding of the gradient instead of one after each op.

Vocab-parallel (TP > 1): each rank holds a slice of the vocabulary, and the max, the sums and the label's
logit are all-reduced over the tensor-parallel group, as in megatron's.

A model computes its loss this way once `use_in(model)` made `language_model_loss` its `compute_language_model_loss`
(`compat.apply("cross_entropy", model=, loss=)`, an instance patch: compat/patches/cross_entropy.py); `engine.build`
does it for every chunk when `fused_cross_entropy` is set. It lives beside `engine`, not in `models/`, for that
reason (imports point down), as megatron keeps its own vocab-parallel cross-entropy in `tensor_parallel/`; the old
path `models.cross_entropy` still imports it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import compat
from ..compat.patches.lazy_compile import lazy
from ..fieldtypes import ConfigError

@lazy(torch.compile)   # compiled at the first call (Triton on GPU, C++ on CPU)
def _stats(logits: torch.Tensor, row_max: torch.Tensor, label: torch.Tensor, in_slice: torch.Tensor):
    """Per token: sum of exp(logit - max) over this rank's vocabulary, and label logit - max (0 where the
    label is another rank's)."""
    x = logits.float() - row_max.unsqueeze(-1)
    picked = torch.gather(x, -1, label.unsqueeze(-1)).squeeze(-1)
    return torch.exp(x).sum(-1), torch.where(in_slice, picked, 0.0)


@lazy(torch.compile)
def _grad(logits: torch.Tensor, shift: torch.Tensor, label: torch.Tensor, in_slice: torch.Tensor,
          grad_loss: torch.Tensor) -> torch.Tensor:
    """d loss / d logits = (softmax - one_hot(label)) x grad_loss, in the logits' dtype; softmax =
    exp(logit - shift) with shift = max + log(sum exp)."""
    x = logits.float()
    vocab = torch.arange(x.shape[-1], device=x.device)
    one_hot = ((vocab == label.unsqueeze(-1)) & in_slice.unsqueeze(-1)).float()
    return ((torch.exp(x - shift.unsqueeze(-1)) - one_hot) * grad_loss.unsqueeze(-1)).to(logits.dtype)


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        vocab_local = logits.shape[-1]
        start = vocab_local * (dist.get_rank(group) if group is not None else 0)
        label = target - start
        in_slice = (label >= 0) & (label < vocab_local)
        label = torch.where(in_slice, label, 0)
        row_max = logits.amax(dim=-1).float()  # exact in the logits' dtype, so no fp32 copy is needed for it
        _all_reduce(row_max, dist.ReduceOp.MAX, group)
        sum_exp, picked = _stats(logits, row_max, label, in_slice)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        _all_reduce(picked, dist.ReduceOp.SUM, group)
        log_sum = torch.log(sum_exp)
        ctx.save_for_backward(logits, row_max + log_sum, label, in_slice)
        return log_sum - picked

    @staticmethod
    def backward(ctx, grad_loss):
        logits, shift, label, in_slice = ctx.saved_tensors
        return _grad(logits, shift, label, in_slice, grad_loss.contiguous()), None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, group=None) -> torch.Tensor:
    """Per-token cross-entropy (fp32, shape of `target`) of `logits` [..., vocab / TP] against the global token
    ids `target` [...]; `group` is the tensor-parallel group whose ranks hold consecutive vocabulary slices."""
    return _CrossEntropy.apply(logits, target, group)


def language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """megatron's LanguageModule.compute_language_model_loss with `cross_entropy`: labels [b, s], logits
    [s, b, vocab / TP] -> per-token losses [b, s]."""
    loss = cross_entropy(logits, labels.transpose(0, 1).contiguous(), group=self.pg_collection.tp)
    return loss.transpose(0, 1).contiguous()


def use_in(model: torch.nn.Module) -> None:
    """Make `model` (a megatron LanguageModule, e.g. GPTModel, before any wrapper) compute its loss with
    `cross_entropy`. Per instance: other models in the process keep megatron's."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    if not isinstance(model, LanguageModule):
        raise ConfigError(f"fused_cross_entropy=True needs a megatron LanguageModule (GPTModel, ...), got "
                          f"{type(model).__name__}; allowed: False for other models")
    compat.apply("cross_entropy", model=model, loss=language_model_loss)
