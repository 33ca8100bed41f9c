"""Deprecated path of `rl.rollout.kernels.sampling` (issue 70): importing it from here warns once and works until
mfsdp_kit 0.2.0 (`kernels.moved`)."""
from .kernels import moved
from .kernels.sampling import *  # noqa: F401,F403

moved("sampling")
