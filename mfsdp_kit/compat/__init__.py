"""The door into megatron-core's and Megatron-Bridge's internals (docs/design.md, "The door into megatron").

- `compat.apply(feature, **objects)` (door.py): the one way a patch of upstream code is turned on; `FEATURES`
  lists them all.
- `compat/patches/`: the modules that change upstream code or a process-wide setting, each a `registry` row with
  its upstream file:line and a still-needed canary (tests/compat/); their turn-on functions are private.
- `compat/access/`: read-only accessors of upstream internals (Megatron-FSDP's buffers and pipelines, the model
  bridge, private torch ops); they change nothing.
- `registry.py`: the rows of what a process has changed (`registry.ACTIVE`).
Importing this package imports no patch module and nothing of megatron.
"""
from .door import FEATURES, apply

__all__ = ["FEATURES", "apply"]
