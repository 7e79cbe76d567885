"""Reinforcement learning with verifiable rewards (GRPO, Dr. GRPO, DAPO): a part of its own.

- `trainer.rl.losses`: group-relative advantages, the clipped per-token objective with a
  k3 KL to the reference, and each loss type's aggregation into one loss per sequence;
- `trainer.rl.rewards`: rewards as Python functions named by import path, run on the
  host, checked.

The rollouts and updates in one program under the training layout build on these.
"""
