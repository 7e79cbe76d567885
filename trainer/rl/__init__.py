"""Reinforcement learning with verifiable rewards (GRPO, Dr. GRPO, DAPO): a part of its own.

- `trainer.rl.trainer`: `RLTrainer`, a `LanguageModelTrainer` whose batches are prompts
  and whose train step draws completions (`trainer.generation.Generator`), scores them
  and updates the policy, in one program under the training layout;
- `trainer.rl.losses`: group-relative advantages, the clipped per-token objective with a
  k3 KL to the reference, and each loss type's aggregation into one loss per sequence;
- `trainer.rl.rewards`: rewards as Python functions named by import path, run on the
  host, checked;
- `trainer.rl.data`: prompt records through the corpus pipeline;
- `trainer.rl.settings`: `config.rl`, checked before anything is built;
- multi-turn rollouts: `trainer.rl.tools` (tools and environments, as TRL takes them),
  `trainer.rl.tool_calls` (an assistant turn's calls read), `trainer.rl.episodes` (each
  rollout's environment and conversation, on the host) and `trainer.rl.multi_turn` (the
  loop that continues each turn from the key/value cache).

`configs/rl.py` holds the fields; `examples/rl_lm.py` runs it.
"""

from trainer.rl.data import example_batch
from trainer.rl.trainer import RL, RLTrainer

__all__ = ["RL", "RLTrainer", "example_batch"]
