"""The transformer LM under a pipeline layout with checkpoints, for the SIGKILL resume test.

    python tests/pipeline_resume_run.py --workdir=W --out=final.npz [--kill_after_save_at=S]

Trains `configs/lm.py:pipeline` (tiny) for 6 steps on batches that are a pure function
of (seed, step), checkpointing every 2 steps and resuming from `W/checkpoints` when it
holds one; writes the final state (checkpoint layout) to `--out`.
"""

import argparse
import logging
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import conftest  # noqa: E402,F401 -- sets the 8 fake devices before jax starts.
import numpy as np  # noqa: E402
from resume_run import flat  # noqa: E402
from small_configs import tiny_lm_config  # noqa: E402
from sweep_run import KillingCheckpointer  # noqa: E402

from trainer.language_model import LanguageModelTrainer, synthetic_token_batches  # noqa: E402

STEPS = 6


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--layout", default="pipeline")
  parser.add_argument("--kill_after_save_at", type=int, default=-1)
  args = parser.parse_args()
  logging.getLogger().setLevel(logging.INFO)
  for noisy in ("absl", "jax", "orbax"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  config = tiny_lm_config(args.layout)
  trainer = LanguageModelTrainer(config)
  checkpointer = KillingCheckpointer(os.path.join(args.workdir, "checkpoints"), every_steps=2,
                                     max_to_keep=3)
  checkpointer.kill_at = args.kill_after_save_at
  stream = lambda start: synthetic_token_batches(  # noqa: E731
      config.seed, config.batch_size, config.seq_len, config.model.vocab_size, start)
  try:
    result = trainer.fit(stream, num_steps=STEPS, checkpointer=checkpointer,
                         workdir=args.workdir)
  finally:
    checkpointer.close()
  np.savez(args.out, **flat(trainer.strategy.checkpoint_state(result.state)))
  print(f"finished at step {result.step}", flush=True)


if __name__ == "__main__":
  main()
