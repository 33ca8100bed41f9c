"""Deprecated path of `rl.rollout.kernels.attention` (issue 70): importing it from here warns once and works until
mfsdp_kit 0.2.0 (`kernels.moved`)."""
from .kernels import moved
from .kernels.attention import *  # noqa: F401,F403

moved("attention")
