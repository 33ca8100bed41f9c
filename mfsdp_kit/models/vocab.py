"""Vocabulary padding for tensor parallelism, and keeping the padding out of everything a user sees.

Megatron splits the embedding and the output layer by vocabulary rows over the TP ranks, so the
vocabulary must divide by TP. Megatron-Bridge 0.3.1 does not pad (`should_pad_vocab` is False and
`make_vocab_size_divisible_by` is chosen to divide the HF vocabulary), so an HF vocabulary of 1003
at TP 2 failed inside megatron (`AssertionError: 1003 is not divisible by 2`). Here, only when TP
does not divide it, the vocabulary is padded the way Megatron pads it: up to a multiple of
`make_vocab_size_divisible_by` (128) * TP - 1003 at TP 2 -> 1024, 21 padded ids.

The padded ids must never leak:
- load: the HF embedding / lm_head rows are copied and the padded rows are zero (`pad_rows`);
- loss: the output layer's logits of padded ids are set to the dtype's lowest value
  (`mask_padded_logits`), so softmax gives them probability 0: the cross-entropy equals HF's over
  the real vocabulary, and their rows get zero gradient (they stay zero through Adam and decay);
- export / sync / save_hf: rows beyond the HF vocabulary are cut off (`trim`), so every tensor
  has the HF shape;
- logits a user sees (`full_logits`, what `generate.logits` and `verify` return): gathered over the TP ranks'
  vocabulary slices, then cut to the real vocabulary (`vocab_size=`).
"""
from __future__ import annotations

import torch

from .. import compat
from ..compat.access import bridge_model
from ..distributed import runtime

DIVISIBLE_BY = 128
"""Megatron's default `make_vocab_size_divisible_by`."""

EMBEDDING_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
"""Megatron parameters whose rows are vocabulary ids."""


def padded_size(vocab_size: int, tp: int, *, divisible_by: int = DIVISIBLE_BY) -> int:
    """The vocabulary megatron builds: unchanged when TP divides it, else Megatron's padding."""
    if vocab_size % tp == 0:
        return vocab_size
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def configure(provider, vocab_size: int, tp: int) -> None:
    """Make the bridge's provider pad (only where TP needs it)."""
    if vocab_size % tp:
        provider.should_pad_vocab = True
        provider.make_vocab_size_divisible_by = DIVISIBLE_BY


def hf_vocab_names(bridge) -> set[str]:
    """HF names of the tensors whose rows are vocabulary ids (embedding, lm_head) for an AutoBridge."""
    return bridge_model.hf_names(bridge, megatron_params=EMBEDDING_PARAMS)


def load_padded(bridge, chunks, padded_vocab: int) -> None:
    """bridge.load_hf_weights, with the vocabulary tensors zero-padded to `padded_vocab` rows."""
    names = hf_vocab_names(bridge)

    def pad_rows(hf_param, weights):
        if isinstance(hf_param, str) and hf_param in names and weights.shape[0] < padded_vocab:
            pad = weights.new_zeros((padded_vocab - weights.shape[0], *weights.shape[1:]))
            weights = torch.cat([weights, pad])
        return weights

    compat.apply("hf_load_hook", bridge=bridge, chunks=chunks, modify=pad_rows)


def mask_padded_logits(chunks, vocab_size: int) -> list:
    """Forward hooks on each chunk's output layer: logits of ids >= vocab_size -> the dtype's lowest.

    The output layer is vocab-parallel: TP rank r holds ids [r * V/tp, (r + 1) * V/tp) of the padded
    V, so each rank masks its own slice's padded columns. Returns the hook handles."""
    from megatron.core import parallel_state as ps
    handles = []
    for chunk in chunks:
        layer = getattr(chunk, "output_layer", None)
        if layer is None:
            continue

        def hook(module, args, output):
            logits, bias = output
            local = logits.shape[-1]
            first = ps.get_tensor_model_parallel_rank() * local
            ids = torch.arange(first, first + local, device=logits.device)
            return logits.masked_fill(ids >= vocab_size, torch.finfo(logits.dtype).min), bias

        handles.append(layer.register_forward_hook(hook))
    return handles


def trim(name: str, tensor: torch.Tensor, vocab_size: int, names: set[str]) -> torch.Tensor:
    """The HF-shaped tensor: vocabulary rows beyond `vocab_size` cut off."""
    if name in names and tensor.shape[0] > vocab_size:
        return tensor[:vocab_size]
    return tensor


def forward_padded(chunks, tokens: torch.Tensor) -> torch.Tensor:
    """The output layer's vocab-parallel logits [batch, seq, vocab / TP] of one forward of the first chunk over
    `tokens` [batch, seq], rows as they are (padding included: causal, it changes no real position)."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    return chunks[0](tokens, positions, None)


@torch.no_grad()
def full_logits(chunks, tokens: torch.Tensor, *, vocab_size: int | None = None, forward=None) -> torch.Tensor:
    """The model's fp32 logits for `tokens` [batch, seq], the same full vocabulary on every tensor-parallel rank,
    on `tokens`' device: `forward(tokens)` (default `forward_padded`) run in eval mode on the runtime's device,
    its vocab-parallel logits all-gathered over the TP group, megatron's padded ids cut off at `vocab_size`.

    The one "forward and gather" of the kit: `train.generate.logits` is this with its own `forward` (rows packed
    where the model can, only the last positions with `last_only`), and `verify` compares this with transformers.
    The chunks go back to the mode they were in. Collective (Megatron-FSDP's gathers, TP's)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    asked_on = tokens.device
    tokens = runtime.to_device(tokens, runtime.current().device)   # where they first meet the embedding's table
    was_training = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    out = forward(tokens) if forward is not None else forward_padded(chunks, tokens)
    for c, mode in zip(chunks, was_training):
        c.train(mode)
    out = gather_from_tensor_model_parallel_region(out)
    return (out if vocab_size is None else out[..., :vocab_size]).float().to(asked_on)
