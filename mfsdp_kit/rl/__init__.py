"""Reinforcement learning on the kit's chunks.

`core` holds what every policy-gradient algorithm shares (collect, group advantages, log-probs,
the update loop, the loss reduction); `grpo`, `dapo` and `ppo` (with `critic`, its value model) compose it;
`rollout` holds the `RolloutBackend` Protocol and the HF backend. A new algorithm is a module next to `dapo`.
"""
