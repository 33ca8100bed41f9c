"""mfsdp_kit: Megatron-FSDP for researchers, one composable step per notebook cell (docs/design.md).

Importing the kit changes nothing in torch or megatron: its patches are installed by `runtime.init` (process-wide
ones: `compat.apply("startup")`) or where a feature is first used (`compat.registry` lists what is active).
"""
