"""Deprecated path of `rl.rollout.engine` (issue 70: the engine, its scheduler and its model runner now have a
module each): `from mfsdp_kit.rl.rollout.continuous import ContinuousRollout, DecodeConfig` warns once and works until
mfsdp_kit 0.2.0. `from mfsdp_kit.rl.rollout import ...` is the spelling that stays."""
import warnings

from ...config.flat import REMOVED_IN
from .engine import ContinuousRollout, DecodeConfig  # noqa: F401

warnings.warn("mfsdp_kit.rl.rollout.continuous is deprecated: import ContinuousRollout and DecodeConfig from "
              f"mfsdp_kit.rl.rollout (or mfsdp_kit.rl.rollout.engine); the old path is removed in mfsdp_kit {REMOVED_IN}",
              DeprecationWarning, stacklevel=2)
