"""Megatron-FSDP (megatron-core 0.16.1) wrapping a model with frozen parameters (LoRA's base).

megatron_fsdp/megatron_fsdp.py:1007-1012 (`_register_fsdp_hooks`) registers a post-accumulate-grad hook on
every parameter of every FSDP unit, with no `requires_grad` filter, and torch refuses that for a frozen one
("cannot register a hook on a tensor that doesn't require gradient"): the wrap fails. Everything else
already serves frozen params: they are grouped apart (param_and_grad_buffer.py:1378), their group gets no
grad and no fp32 main-weight buffer (:1965, `only_create_grad_buffer_and_main_weight_buffer_for_param_
requires_grad` defaults True at :1559) while its compute weights are sharded like the others, the grad
hook returns early for them (megatron_fsdp.py:555) and the optimizer skips them (optimizer/__init__.py:147).

The patch: while `_register_fsdp_hooks` runs, frozen params say requires_grad=True, so the hook can be
registered; afterwards their hooks are removed (they would never fire) and they are frozen again. Delete
when `still_needed()` is False.
"""
from __future__ import annotations

import functools
import inspect

from .. import registry

UPSTREAM = "megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py:1007-1012"
TARGET = "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp:MegatronFSDP._register_fsdp_hooks"


def _cls():
    from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP
    return MegatronFSDP


def still_needed() -> bool:
    """True while the grad-accumulation hook loop registers hooks on frozen params too."""
    fn = _cls()._register_fsdp_hooks
    source = inspect.getsource(getattr(fn, "__wrapped__", fn))
    loop = source[source.index("for param in grad_acc_param_list"):]
    return "requires_grad" not in loop[:loop.index("register_post_accumulate_grad_hook")]


def _frozen_hooks_skipped(original):
    @functools.wraps(original)
    def register(self, root_module):
        frozen = [(name, p) for name, p in self.module.named_parameters() if not p.requires_grad]
        for _, p in frozen:
            p.requires_grad_(True)
        try:
            original(self, root_module)
        finally:
            for name, p in frozen:
                p.requires_grad_(False)
                handle = self.grad_acc_hooks.pop(f"grad_acc and reduce for {self.param_to_name[p]}", None)
                if handle is not None:
                    handle.remove()
    return register


def _enable() -> bool:
    """Install the patch (once); returns whether it did."""
    cls = _cls()
    if hasattr(cls._register_fsdp_hooks, "__wrapped__") or not still_needed():
        return False
    cls._register_fsdp_hooks = _frozen_hooks_skipped(cls._register_fsdp_hooks)
    registry.record(registry.Patch(target=TARGET, upstream=UPSTREAM, needed_if=still_needed))
    return True
