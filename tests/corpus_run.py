"""A language model trained on a test corpus, for the test that kills it mid-epoch.

    python tests/corpus_run.py --workdir=W --corpus=DIR [--kill_at=7]

DIR holds `corpus_files.write_corpus`'s files. The run trains 12 steps of the small LM
(`configs/lm.py`, one device) on them, checkpointing every 4 and resuming from
`W/checkpoints` when it holds one. Each batch read is appended to `W/batches.jsonl`
(step, digest); the final parameters go to `W/final.npz`. `--kill_at=S` SIGKILLs the
process after step S.
"""

import argparse
import hashlib
import json
import logging
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import conftest  # noqa: E402,F401 -- sets the 8 fake devices before jax starts.
import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import lm as lm_config  # noqa: E402
from trainer import LanguageModelTrainer  # noqa: E402
from trainer.checkpoint import Checkpointer  # noqa: E402
from trainer.data import lm  # noqa: E402
from trainer.loop.actions import PeriodicCallback  # noqa: E402

STEPS = 12


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--corpus", required=True)
  parser.add_argument("--kill_at", type=int, default=-1)
  args = parser.parse_args()
  logging.getLogger().setLevel(logging.INFO)
  for noisy in ("absl", "jax", "orbax"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  config = lm_config.get_config()
  config.strategy.name = "single_device"
  config.model.vocab_size = 256
  config.seq_len = 16
  config.batch_size = 8
  config.checkpoint.every_steps = 4
  config.log_every_steps = 4
  config.data.update(sources=(os.path.join(args.corpus, "corpus"),), tokenizer=args.corpus,
                     lanes=4)
  trainer = LanguageModelTrainer(config)
  corpus = lm.from_config(config, trainer.strategy.process_slice(config.batch_size))
  os.makedirs(args.workdir, exist_ok=True)
  log = open(os.path.join(args.workdir, "batches.jsonl"), "a")  # noqa: SIM115

  def stream(start):
    iterator = corpus(start)

    class Logged:  # The corpus iterator, each batch's digest logged with its step.
      step = start

      def __iter__(self):
        return self

      def __next__(self):
        batch = next(iterator)
        digest = hashlib.sha256(b"".join(np.ascontiguousarray(batch[k]).tobytes()
                                         for k in sorted(batch))).hexdigest()
        log.write(json.dumps({"step": Logged.step, "digest": digest}) + "\n")
        log.flush()
        Logged.step += 1
        return batch

      def get_state(self):
        return iterator.get_state()

      def set_state(self, state):
        iterator.set_state(state)
        # The loop reads the resumed step's batch next.
        Logged.step = trainer_steps["resumed"]

    return Logged()

  checkpointer = Checkpointer(os.path.join(args.workdir, "checkpoints"), every_steps=4,
                              max_to_keep=5)
  trainer_steps = {"resumed": checkpointer.latest_step() or 0}

  def kill(view):
    if view.step == args.kill_at:
      checkpointer.wait()  # The save of step 4 has landed: the kill comes 3 steps after it.
      os.kill(os.getpid(), signal.SIGKILL)

  try:
    result = trainer.fit(stream, num_steps=STEPS, checkpointer=checkpointer,
                         actions=[PeriodicCallback(kill, every_steps=1)])
  finally:
    checkpointer.close()
  params = trainer.strategy.to_canonical(result.state).params
  np.savez(os.path.join(args.workdir, "final.npz"),
           **{jax.tree_util.keystr(p): np.asarray(x)
              for p, x in jax.tree_util.tree_leaves_with_path(jax.device_get(params))})


if __name__ == "__main__":
  main()
