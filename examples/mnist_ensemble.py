r"""Trains an MNIST CNN (or BatchNorm ResNet) ensemble, or one model, under any strategy.

    python examples/mnist_ensemble.py --config=configs/mnist_ensemble.py \
        --workdir=/tmp/mnist_ensemble [--config.strategy.name=pmap_data_parallel]
    python examples/mnist_ensemble.py --config=configs/mnist_resnet_ensemble.py \
        --workdir=/tmp/mnist_resnet
    python examples/mnist_ensemble.py --config=configs/mnist_on_device.py \
        --workdir=/tmp/mnist_on_device
    python examples/mnist_ensemble.py --config=configs/mnist_finetune.py:pretrain \
        --workdir=/tmp/mnist_pretrain
    python examples/mnist_ensemble.py --config=configs/mnist_finetune.py:finetune \
        --workdir=/tmp/mnist_finetune --config.init_from.path=/tmp/mnist_pretrain

The last keeps the train split on the devices and runs many steps per
compiled call (`config.steps_per_call`): the host only dispatches. The last two
pretrain a CNN on digits 0-4, then fine-tune it on 5-9 with its convolutions
frozen and a new head (`configs/mnist_finetune.py`).

The ResNet's BatchNorm statistics live in the train state (`model_state`):
per member in an ensemble, over the global batch under data parallelism.

TensorBoard event files, `metrics.jsonl` and orbax checkpoints
(`checkpoints/<step>`) go to `--workdir`. Running the same command again in
the same workdir resumes from the latest complete checkpoint; on SIGTERM or Ctrl-C the
run saves a checkpoint and exits 0.

On several processes (each feeding its rows of every batch; logs and files
from process 0):

    python -m trainer.distributed.launch --num_processes 2 examples/mnist_ensemble.py \
        --config=configs/mnist_ensemble.py --workdir=/tmp/mnist_2x4
"""

import os
import sys

from absl import app, flags, logging

# Run from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import models  # noqa: E402
from trainer import ClassificationTrainer  # noqa: E402  (imports jax; starts no backend)
from trainer import config as config_lib  # noqa: E402
from trainer.run import workdir as workdir_lib  # noqa: E402

FLAGS = flags.FLAGS
#: config.data.pipeline: streamed by Grain, read into host memory, or placed on the devices.
PIPELINES = ("grain", "memory", "device")
# An ml_collections config file, locked: an override must name one of its fields.
config_lib.define_config_file(
    os.path.join(os.path.dirname(__file__), "..", "configs", "mnist_ensemble.py"),
    "Training configuration (an ml_collections config file).")
flags.DEFINE_string("workdir", None, "Directory for TensorBoard events and metrics.jsonl.")
flags.mark_flags_as_required(["workdir"])
# A --workdir that cannot be a directory is refused while the flags are parsed.
flags.register_validator("workdir", workdir_lib.flag_validator)


class MNISTTrainer(ClassificationTrainer):
  """The CNN or the BatchNorm ResNet of `config.model.name`, 10 classes."""

  def build_model(self):
    m = self.config.model
    if m.name == "resnet":
      return models.ResNet(stage_sizes=tuple(m.stage_sizes), num_filters=m.num_filters,
                           num_classes=10)
    if m.name == "cnn":
      return models.CNN(num_classes=10)
    raise ValueError(f"config.model.name={m.name!r} is not one of ('cnn', 'resnet').")


def example_batch(config) -> dict[str, np.ndarray]:
  """One train batch's shapes (MNIST images scaled to [0, 1], int labels), for the dry run
  (`python -m trainer.plan --config=configs/mnist_ensemble.py`)."""
  return {"image": np.zeros((config.batch_size, 28, 28, 1), np.float32),
          "label": np.zeros((config.batch_size,), np.int32)}


def train_and_evaluate(config, workdir: str) -> dict[str, float] | None:
  """Trains as `config` says and returns the final eval metrics (None if stopped early).

  The checkpointer, the data and the Trainer are built before any training
  step, so a bad strategy, mesh, batch size, recipe or checkpoint setting
  fails before compute is spent; the Trainer comes after the data because a
  decaying learning-rate schedule needs the run's length in steps.
  """
  from trainer import data, writers
  from trainer.checkpoint import Checkpointer
  from trainer.data import pipeline

  writers.check_writers(config.writers)
  d = config.data
  if d.pipeline not in PIPELINES:
    raise ValueError(f"config.data.pipeline={d.pipeline!r} is not one of {PIPELINES}.")
  if d.classes and d.pipeline == "grain":
    raise ValueError(f"config.data.classes={tuple(d.classes)!r} selects examples in memory: "
                     f"set config.data.pipeline to 'memory' or 'device' (it is 'grain').")
  checkpointer = Checkpointer.from_config(config, workdir)
  builder = data.prepare(d.name, d.data_dir, d.manual_dir,
                         file_format="array_record" if d.pipeline == "grain" else None)
  if d.pipeline == "grain":  # Streamed: nothing is read before the loop asks for it.
    train = data.data_source(builder, d.train_split, field="data.train_split")
    test = data.data_source(builder, d.eval_split, field="data.eval_split")
  else:
    train = data.load_split(builder, d.train_split, field="data.train_split")
    test = data.load_split(builder, d.eval_split, field="data.eval_split")
    if d.classes:
      train, test = train.with_classes(d.classes), test.with_classes(d.classes)
  num_steps = data.num_train_steps(config, len(train))
  trainer = MNISTTrainer(config, num_train_steps=num_steps)
  if d.pipeline == "grain":
    train_batches = pipeline.GrainBatches(
        train, batch_size=config.batch_size, seed=config.seed,
        shard=pipeline.shard_options(trainer.strategy.process_rows()),
        read_threads=d.read_threads, prefetch_batches=d.prefetch_batches)
    eval_batches = lambda: pipeline.eval_batches(test, config.eval_batch_size)  # noqa: E731
  elif d.pipeline == "device":  # Placed on the devices once; each step gathers its batch.
    train_batches = train.device_data(config.batch_size, config.seed)
    eval_batches = lambda: data.eval_batches(test, config.eval_batch_size)  # noqa: E731
  else:
    rows = trainer.strategy.process_slice(config.batch_size)  # This process's rows.
    train_batches = lambda start: data.train_batches(  # noqa: E731
        train, config.batch_size, config.seed, start, rows=rows)
    eval_batches = lambda: data.eval_batches(test, config.eval_batch_size)  # noqa: E731
  logging.info("Training %d steps (%d examples per epoch) with %s", num_steps, len(train),
               trainer.strategy.describe())

  writer = writers.create_writer(workdir, config.writers, config)
  try:
    result = trainer.fit(train_batches, num_steps=num_steps, checkpointer=checkpointer,
                         writer=writer, workdir=workdir, eval_batches=eval_batches)
  finally:
    checkpointer.close()
    writer.close()
  from trainer.sweep import FINISHED
  if result.stopped_by is not None and result.stopped_by != FINISHED:  # A sweep's end is done.
    logging.info("Stopped by %s at step %d; best eval %s", result.stopped_by, result.step,
                 result.best)
    return None
  return result.final_eval


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  # Before anything initialises jax's backends: the processes of a multi-process
  # run (`python -m trainer.distributed.launch`, or a cluster's environment) and how many
  # host devices a CPU run has.
  from trainer.distributed import devices
  devices.initialize(FLAGS.config.num_cpu_devices)
  with devices.naming_the_process():
    results = train_and_evaluate(FLAGS.config, FLAGS.workdir)
  if results is None:
    logging.info("Stopped early after saving; run the same command to resume.")
    return
  logging.info("Final eval: %s", results)
  if devices.is_primary():
    print(" ".join(f"{k}={v:.4f}" for k, v in sorted(results.items())))


if __name__ == "__main__":
  # An override of a field the config lacks is refused naming the field (and, under
  # sweep.grid, what can be swept) instead of ml_collections' bare AttributeError.
  config_lib.run(main)
