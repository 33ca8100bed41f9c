"""weights.views against Megatron-Bridge's own split functions (no ranks): the fused QKV of a GQA
layer (weights and biases) and the gated fc1 halves are views that select the bridge's elements."""
from functools import partial
from types import SimpleNamespace

import torch

from mfsdp_kit.weights import views


def test_qkv_views_select_the_bridges_split():
    views.recognised()  # imports the bridge the kit's way (compat placeholders without TE)
    from megatron.bridge.models.conversion.param_mapping import split_qkv_biases, split_qkv_weights
    config = SimpleNamespace(num_attention_heads=8, num_query_groups=2, kv_channels=4, hidden_size=32)
    rows = (8 + 2 * 2) * 4
    for full, split in ((torch.randn(rows, 32), split_qkv_weights), (torch.randn(rows), split_qkv_biases)):
        for part, want in zip("qkv", split(config, full)):
            got = views.qkv(full, groups=2, per_group=4, head_size=4, part=part)
            assert got.data_ptr() >= full.data_ptr() and got._base is full   # a view: no copy
            assert torch.equal(got.reshape(want.shape), want)


def test_gated_halves_and_vocabulary_rows_are_views():
    full = torch.randn(6, 3)
    gate, up = (views.half(full, index=i) for i in (0, 1))
    assert torch.equal(gate, full[:3]) and torch.equal(up, full[3:]) and gate._base is full
    assert torch.equal(views.rows(full, view=views.whole, rows=4), full[:4])


def test_only_exact_mapping_classes_are_recognised():
    """A subclass may change values (RMSNorm2ZeroCenteredRMSNormMapping adds 1): not recognised."""
    table = views.recognised()
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, RMSNorm2ZeroCenteredRMSNormMapping
    assert AutoMapping in table
    assert issubclass(RMSNorm2ZeroCenteredRMSNormMapping, AutoMapping)
    assert RMSNorm2ZeroCenteredRMSNormMapping not in table


def test_lora_targets_views_select_rows_and_a_transpose_does_not():
    """A LoRA-adapted weight's views must pick whole rows (weights.plan then adds view(B) A where view(W) went)."""
    probe = torch.randn(12 * 4, 32)
    assert views.selects_rows(partial(views.qkv, groups=2, per_group=4, head_size=4, part="k"), probe)
    assert views.selects_rows(partial(views.half, index=1), probe)
    assert views.selects_rows(views.whole, probe)
    assert not views.selects_rows(partial(views.permuted, dims=(1, 0)), probe)
    assert not views.selects_rows(views.whole, torch.randn(8))   # a bias: nothing to merge
