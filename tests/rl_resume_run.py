"""An RL run (`configs/rl.py:addition`, tiny) with checkpoints, for the SIGKILL resume test.

    RL_ROLLOUT_LOG=rollouts.jsonl python tests/rl_resume_run.py --workdir=W --out=final.npz \
        [--kill_at=S | --kill_after_save_at=S] [--reward=module:function ...] [--tools]

Trains 8 steps under FSDP on 8 host devices, checkpointing every 4 steps and resuming from
`W/checkpoints` when it holds one; each step's rollouts (prompt and completion ids) are
appended to `$RL_ROLLOUT_LOG` by a reward (`rl_rewards.recorded`). `--kill_at=S` SIGKILLs
the process once step S is done (between checkpoints); `--kill_after_save_at=S` once the
checkpoint of step S is complete. Writes the final state (checkpoint layout) to `--out`.
`--tools`: the tool-use task (`configs/rl.py:tools`, from scratch) with every rollout's first
turn a scripted `lookup` call (`tool_setup.calling_policy`), so each rollout holds a tool
turn whose result its environment draws from the step's and the row's seed.
"""

import argparse
import logging
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "examples")]

import conftest  # noqa: E402,F401 -- sets the 8 fake devices before jax starts.
import numpy as np  # noqa: E402
import rl_tasks  # noqa: E402
from resume_run import flat  # noqa: E402
from sweep_run import fit_killed  # noqa: E402

STEPS = 8


def config_for(task_dir: str):
  from configs import lm, rl
  prompts, tokenizer = rl_tasks.write_addition(task_dir)
  config = rl.get_config("addition")
  config.data.update(sources=(prompts,), tokenizer=tokenizer, workers=0, lanes=1)
  config.update(batch_size=8, num_train_steps=STEPS, log_every_steps=1000)
  config.rl.num_generations = 4
  config.rl.beta = 0.05  # The reference copy is checkpointed and restored too.
  config.rl.rewards = (f"{rl.TASKS}:correct_sum", "rl_rewards:recorded")
  shape, axes, rules = lm.LAYOUTS["fsdp"]
  config.strategy.update(name="sharded_data_parallel", mesh_shape=shape, mesh_axes=axes,
                         logical_axis_rules=rules)
  return config


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--kill_at", type=int, default=-1)
  parser.add_argument("--kill_after_save_at", type=int, default=-1)
  parser.add_argument("--reward", action="append", default=[],
                      help="A reward function to add (import path).")
  parser.add_argument("--tools", action="store_true")
  args = parser.parse_args()
  logging.getLogger().setLevel(logging.INFO)
  for noisy in ("absl", "jax", "orbax"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  import tool_setup

  from configs import lm
  from trainer.rl import RLTrainer
  from trainer.rl import data as rl_data
  config = (tool_setup.table_config if args.tools else config_for)(
      os.path.join(args.workdir, "task"))
  if args.tools:
    config.update(batch_size=8, num_train_steps=STEPS)
    config.rl.rewards = (*config.rl.rewards, "rl_rewards:recorded")
    shape, axes, rules = lm.LAYOUTS["fsdp"]
    config.strategy.update(name="sharded_data_parallel", mesh_shape=shape, mesh_axes=axes,
                           logical_axis_rules=rules)
  config.rl.rewards = (*config.rl.rewards, *args.reward)
  trainer = RLTrainer(config)
  if args.tools:
    trainer.multi_turn.policy = tool_setup.calling_policy(trainer)
  result = fit_killed(trainer, rl_data.from_config(config), num_steps=STEPS,
                      workdir=args.workdir, kill_at=args.kill_at,
                      kill_after_save_at=args.kill_after_save_at)
  np.savez(args.out, **flat(trainer.strategy.checkpoint_state(result.state)))
  print(f"finished at step {result.step}", flush=True)


if __name__ == "__main__":
  main()
