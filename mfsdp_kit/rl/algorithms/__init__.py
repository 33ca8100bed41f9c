"""The RL algorithms, one registration each (`registration.Algorithm`: its config, its loss and, where it has them,
its filter and advantage estimator), run by the one loop (`rl.loop.fit`). A new algorithm is one module here and
its test in tests/rl/algorithms/.

    grpo          group-normalised advantages, the clipped ratio with a k3 KL (every algorithm's policy loss here)
    dapo          GRPO + dynamic sampling (its filter), token-level loss, clip-higher
    rloo          GRPO's loss, a leave-one-out baseline
    reinforce_pp  GRPO's loss, advantages whitened over the batch
    ppo           GRPO's loss on per-token GAE advantages from a critic that trains beside the policy
"""
from .dapo import DAPO, DAPOConfig  # noqa: F401
from .grpo import GRPO, GRPOConfig  # noqa: F401
from .ppo import PPO, PPOConfig  # noqa: F401
from .registration import REGISTRY, Algorithm, Estimate, Models, Sampled, of, register  # noqa: F401
from .reinforce_pp import REINFORCE_PP, ReinforcePPConfig  # noqa: F401
from .rloo import RLOO, RLOOConfig  # noqa: F401
