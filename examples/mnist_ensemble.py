r"""Trains an MNIST CNN ensemble (or one CNN) under any registered strategy.

    python examples/mnist_ensemble.py --config=configs/mnist_ensemble.py \
        --workdir=/tmp/mnist_ensemble [--config.strategy.name=pmap_data_parallel]

TensorBoard event files and `metrics.jsonl` go to `--workdir`.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

# Run from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "mnist_ensemble.py"),
    "Training configuration (an ml_collections config file).", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for TensorBoard events and metrics.jsonl.")
flags.mark_flags_as_required(["workdir"])


def train_and_evaluate(config, workdir: str) -> dict[str, float]:
  """Trains as `config` says and returns the final eval metrics.

  The Trainer is built first, so a bad strategy, mesh or batch size fails
  before any data is read.
  """
  import models
  from trainer import ClassificationTrainer, data, writers

  class MNISTTrainer(ClassificationTrainer):
    def build_model(self):
      return models.CNN(num_classes=10)

  trainer = MNISTTrainer(config)
  builder = data.prepare(config.data.name, config.data.data_dir, config.data.manual_dir)
  train, test = data.load_split(builder, "train"), data.load_split(builder, "test")
  num_steps = data.num_train_steps(config, len(train))
  logging.info("Training %d steps (%d examples per epoch) with %s", num_steps, len(train),
               trainer.strategy.describe())

  writer = writers.create_writer(workdir)
  writer.write_hparams(config.to_dict())
  trainer.fit(
      data.train_batches(train, config.batch_size, config.seed), num_steps=num_steps,
      eval_batches=lambda: data.eval_batches(test, config.eval_batch_size), writer=writer)
  writer.close()
  return trainer.eval_history[-1][1]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  # Before anything initialises jax's backends: how many host devices a CPU run has.
  from trainer.devices import set_num_cpu_devices
  set_num_cpu_devices(FLAGS.config.get("num_cpu_devices", 0))
  results = train_and_evaluate(FLAGS.config, FLAGS.workdir)
  logging.info("Final eval: %s", results)
  print(" ".join(f"{k}={v:.4f}" for k, v in sorted(results.items())))


if __name__ == "__main__":
  app.run(main)
