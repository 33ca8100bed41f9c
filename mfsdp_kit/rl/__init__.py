"""Reinforcement learning on the kit's chunks.

`core` holds what every policy-gradient algorithm shares (collect, advantages, log-probs, the update, the loss
reduction); `algorithms` holds each algorithm as a registration (its config, its loss, and where it has them its
filter and advantage estimator: GRPO, DAPO, RLOO, REINFORCE++, PPO with `critic`, its value model); `loop` runs any of
them (the one `iteration` and `fit`, one `History`); `grpo`, `dapo` and `ppo` are their notebook spellings;
`rollout` holds the `RolloutBackend` Protocol and the backends. A new algorithm is a module in `algorithms/`.
"""
