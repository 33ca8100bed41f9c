"""compat.access.aten: torch's private varlen flash-attention ops still take the positional arguments the kit passes,
in its order (a torch upgrade that renames or reorders them fails here, on CPU, before a GPU run computes attention
with swapped arguments), and they are still needed (no public varlen attention with dropout yet)."""
import torch

from mfsdp_kit.compat import registry
from mfsdp_kit.compat.access import aten


def positional(op) -> tuple[str, ...]:
    """The names of the op's positional (not keyword-only) arguments, in order."""
    return tuple(a.name for a in op.default._schema.arguments if not a.kwarg_only)


def test_forward_schema_has_the_kit_order():
    names = positional(torch.ops.aten._flash_attention_forward)
    assert names[:len(aten.FORWARD_ARGS)] == aten.FORWARD_ARGS, names
    assert len(names) == len(aten.FORWARD_ARGS), f"a new positional argument: {names}"
    keyword = {a.name for a in torch.ops.aten._flash_attention_forward.default._schema.arguments if a.kwarg_only}
    assert "scale" in keyword


def test_backward_schema_has_the_kit_order():
    names = positional(torch.ops.aten._flash_attention_backward)
    assert names == aten.BACKWARD_ARGS, names
    keyword = {a.name for a in torch.ops.aten._flash_attention_backward.default._schema.arguments if a.kwarg_only}
    assert "scale" in keyword


def test_outputs_are_what_the_kit_unpacks():
    assert len(torch.ops.aten._flash_attention_forward.default._schema.returns) == 5   # out, lse, rng, unused, mask
    assert len(torch.ops.aten._flash_attention_backward.default._schema.returns) == 3  # dq, dk, dv


def test_still_needed_and_written_for_this_torch():
    assert aten.ROW.still_needed(), "torch's public varlen_attn takes dropout_p now: call it, delete compat.access.aten"
    assert registry.written_for_installed("torch"), (registry.installed_version("torch"), registry.WRITTEN_FOR)
    assert ":" in aten.ROW.target and aten.ROW.package == "torch"
