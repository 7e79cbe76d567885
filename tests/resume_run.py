"""A small training run with checkpoints, for tests that kill or stop a real process.

    python tests/resume_run.py --workdir=W --strategy=pmap_data_parallel --steps=24 \
        --every=4 --out=final.npz [--batch_delay=0.05] [--kill_during_save_at=8] \
        [--watchdog=2 --hang_at=10]

Trains the test MLP on batches that are a pure function of (seed, step),
resuming from `W/checkpoints` when it holds one, and writes the final state
(checkpoint layout) to `--out`. `--kill_during_save_at=S` SIGKILLs the process
right after the save of step S has started, while orbax is still writing it.
`--hang_at=S` makes the step after S hang (an action that sleeps) the first time
the run gets there (a marker file in the workdir remembers it); with
`--watchdog=SECONDS` (`config.watchdog_seconds`) the watchdog ends the process.
"""

import argparse
import logging
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import conftest  # noqa: E402 -- sets the 8 fake devices before jax starts.
import jax  # noqa: E402
import numpy as np  # noqa: E402

from trainer.checkpoint import Checkpointer  # noqa: E402
from trainer.loop.actions import PeriodicCallback  # noqa: E402
from trainer.run.start import step_of  # noqa: E402

DIM = 8


def batch(step: int, size: int = 16) -> dict[str, np.ndarray]:
  rng = np.random.default_rng((123, step))
  return {"inputs": rng.normal(size=(size, DIM)).astype(np.float32),
          "targets": rng.normal(size=(size, DIM)).astype(np.float32)}


def flat(tree) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}


class KillingCheckpointer(Checkpointer):
  """Dies by SIGKILL while the save of one step is still being written."""

  kill_at: int = -1

  def save(self, step, state, layout, **kwargs):
    super().save(step, state, layout, **kwargs)
    if step == self.kill_at:
      os.kill(os.getpid(), signal.SIGKILL)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--strategy", default="pmap_data_parallel")
  parser.add_argument("--steps", type=int, default=24)
  parser.add_argument("--every", type=int, default=4)
  parser.add_argument("--out", required=True)
  parser.add_argument("--batch_delay", type=float, default=0.0)
  parser.add_argument("--kill_during_save_at", type=int, default=-1)
  parser.add_argument("--hang_at", type=int, default=-1)
  parser.add_argument("--watchdog", type=float, default=0.0)
  args = parser.parse_args()
  logging.getLogger().setLevel(logging.INFO)
  for noisy in ("absl", "jax", "orbax"):
    logging.getLogger(noisy).setLevel(logging.WARNING)

  config = conftest.mlp_config(**{"strategy.name": args.strategy, "log_every_steps": 4,
                                  "watchdog_seconds": args.watchdog})
  trainer = conftest.MLPTrainer(config)
  checkpointer = KillingCheckpointer(os.path.join(args.workdir, "checkpoints"),
                                     every_steps=args.every, max_to_keep=3)
  checkpointer.kill_at = args.kill_during_save_at

  def batches(start):
    step = start
    while True:
      time.sleep(args.batch_delay)  # A slow input pipeline: time to kill the run mid-way.
      yield batch(step)
      step += 1

  marker = os.path.join(args.workdir, "hung_once")

  def hang(view):  # A stuck collective, a dead filesystem: nothing returns.
    if view.step == args.hang_at + 1 and not os.path.exists(marker):
      open(marker, "w").close()
      time.sleep(3600)

  actions = [PeriodicCallback(hang, every_steps=1)] if args.hang_at >= 0 else []
  try:
    result = trainer.fit(batches, num_steps=args.steps, checkpointer=checkpointer,
                         actions=actions, workdir=args.workdir)
  finally:
    checkpointer.close()
  state = result.state
  if result.stopped_by is None:
    np.savez(args.out, **flat(trainer.strategy.checkpoint_state(state)))
    print(f"finished at step {step_of(state, trainer.strategy)}", flush=True)


if __name__ == "__main__":
  main()
