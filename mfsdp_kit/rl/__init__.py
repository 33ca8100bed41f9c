"""Reinforcement learning on the kit's chunks: GRPO (`rl.grpo`)."""
