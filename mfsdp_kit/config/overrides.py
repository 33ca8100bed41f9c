"""The checks of `EngineConfig`'s two override dicts: `wrapper.override_ddp_config` (megatron's
DistributedDataParallelConfig fields) and `override_transformer_config` (TransformerConfig fields).

Known keys only, with close matches for a typo; each value of the megatron field's annotated type and, where
the sane range is obvious, in it; the layout keys that must agree with the process groups are refused here and
set on the config's own fields instead (the experts' sizes; HSDP's instances, `config.flat.HSDP_KEY`).
"""
from __future__ import annotations

import difflib
import functools
from typing import Any, Callable

from .flat import HSDP_FIELD, HSDP_KEY
from ..fieldtypes import ConfigError, bad_value, field_types, finite, type_error

DDP_NAME, TRANSFORMER_NAME = "wrapper.override_ddp_config", "override_transformer_config"
"""How the messages name the two dicts (their paths in EngineConfig)."""
EXPERT_LAYOUT_KEYS = ("expert_model_parallel_size", "expert_tensor_parallel_size")
"""TransformerConfig fields that must agree with the process groups `runtime.init` builds: a model
built with EP 2 over groups of EP 1 routes tokens to experts no rank holds."""


def check(*, override_ddp_config: dict, override_transformer_config: dict) -> None:
    """Raise `ConfigError` for the first bad key or value of either dict."""
    _check_dict(DDP_NAME, override_ddp_config, _ddp_types, DDP_RANGES)   # megatron imported only for a key
    _check_dict(TRANSFORMER_NAME, override_transformer_config, _transformer_types, TRANSFORMER_RANGES)
    if HSDP_KEY in override_ddp_config:   # left there only when it disagrees with the field (config.flat)
        raise bad_value(f"{DDP_NAME}.{HSDP_KEY}", override_ddp_config[HSDP_KEY],
                        f"absent: set {HSDP_FIELD} instead (runtime.init builds HSDP's groups from it)")
    for key in EXPERT_LAYOUT_KEYS:
        if key in override_transformer_config:
            allowed = ("absent: set parallelism.expert_model_parallel_size instead (runtime.init builds the "
                       "expert-parallel groups from it and the model config follows)" if key.startswith("expert_model")
                       else "absent: the expert tensor-parallel size is tensor_model_parallel_size (the kit's "
                            "runtime builds expert groups with megatron's default)")
            raise bad_value(f"{TRANSFORMER_NAME}.{key}", override_transformer_config[key], allowed)


@functools.cache
def _ddp_types() -> dict[str, tuple[Any, Any]]:
    from megatron.core.distributed import DistributedDataParallelConfig
    return field_types(DistributedDataParallelConfig)


@functools.cache
def _transformer_types() -> dict[str, tuple[Any, Any]]:
    from megatron.core.transformer import TransformerConfig
    return field_types(TransformerConfig)


def _at_least(lo: int, *, none_ok: bool = False) -> tuple[Callable[[Any], bool], str]:
    """For integer fields (the type check runs first)."""
    return (lambda v: v >= lo), (f"None or an integer >= {lo}" if none_ok else f"an integer >= {lo}")


def _probability() -> tuple[Callable[[Any], bool], str]:
    return (lambda v: 0 <= v <= 1), "a number in [0, 1]"


def _positivefinite() -> tuple[Callable[[Any], bool], str]:
    return (lambda v: finite(v) and v > 0), "a finite number > 0"


DDP_RANGES = dict(
    bucket_size=_at_least(1, none_ok=True),                    # elements per gradient bucket
    suggested_communication_unit_size=_at_least(1, none_ok=True),
)
"""Ranges of override_ddp_config values (checked after the type; None passes where it is the default)."""
TRANSFORMER_RANGES = dict(
    num_layers=_at_least(1), hidden_size=_at_least(1), num_attention_heads=_at_least(1),
    num_query_groups=_at_least(1, none_ok=True), ffn_hidden_size=_at_least(1, none_ok=True),
    kv_channels=_at_least(1, none_ok=True), hidden_dropout=_probability(), attention_dropout=_probability(),
    layernorm_epsilon=_positivefinite(), init_method_std=_positivefinite(),
)
"""Ranges of override_transformer_config values where the sane range is obvious."""


def _check_dict(field_name: str, overrides: dict, types_of: Callable[[], dict[str, tuple[Any, Any]]],
                ranges: dict[str, tuple[Callable[[Any], bool], str]]) -> None:
    """Known keys only (with close matches), each value of the megatron field's type (`types_of()`, called only
    when there is a key: an empty dict needs no megatron import) and in its range."""
    if not isinstance(overrides, dict):
        raise bad_value(field_name, overrides, "a dict of field -> value")
    if not overrides:
        return
    types_ = types_of()
    allowed = list(types_)
    for key, value in overrides.items():
        if key not in types_:
            close = difflib.get_close_matches(key, allowed, n=3)
            hint = f"did you mean {close}?" if close else f"see the {len(allowed)} fields of the megatron config"
            raise ConfigError(f"{field_name}: unknown key {key!r}; {hint} (allowed: {', '.join(sorted(allowed))})")
        tp, default = types_[key]
        if err := type_error(f"{field_name}.{key}", value, tp, default):
            raise err
        if key in ranges and value is not None and not ranges[key][0](value):
            raise bad_value(f"{field_name}.{key}", value, ranges[key][1])
