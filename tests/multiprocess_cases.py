"""The runs that tests train on 2 processes x 4 devices and on 1 process x 8 devices.

Shared by `tests/multiprocess_run.py` (the multi-process side, started by
`python -m trainer.distributed.launch`) and `tests/test_multiprocess.py` (the one-process
reference). Importing this sets up no devices. Each case is a model written
the Flax examples' way, a config and a stream of global batches that is a pure
function of (seed, step); each process takes its rows of every batch.
"""

from __future__ import annotations

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from small_configs import tiny_lm_config

import models
from configs import mlp_sharded, mnist_ensemble
from trainer import ClassificationTrainer, Trainer

NUM_STEPS = 4
SAVE_EVERY = 2


def _image_config(**overrides) -> ml_collections.ConfigDict:
  config = mnist_ensemble.get_config()
  config.batch_size = 16
  config.eval_batch_size = 16
  config.learning_rate = 0.05
  config.log_every_steps = 1
  config.eval_every_steps = 0
  config.checkpoint.every_steps = SAVE_EVERY
  config.checkpoint.async_save = True
  config.update_from_flattened_dict(overrides)
  return config


def config_of(case: str) -> ml_collections.ConfigDict:
  """The config of a case (the strategy is part of it)."""
  if case == "resnet_dp":  # Linen ResNet, BatchNorm(axis_name='batch'): jit DP on 8 devices.
    return _image_config(**{"strategy.name": "sharded_data_parallel",
                            "strategy.mesh_shape": (8,), "strategy.mesh_axes": ("data",),
                            "strategy.logical_axis_rules": (("batch", "data"),)})
  if case == "nnx_ensemble":  # NNX BatchNorm + dropout; 4 members x 2 data devices each.
    config = _image_config(**{"strategy.name": "sharded_ensemble"})
    config.ensemble_size = 4
    config.strategy.ensemble_mesh_shape = (4, 2)
    config.dropout_rate = 0.1
    return config
  if case == "device_ensemble":  # nnx_ensemble's setup, the split on the devices, 2 steps a call.
    config = config_of("nnx_ensemble")
    config.steps_per_call = 2
    return config
  if case == "sweep_ensemble":  # nnx_ensemble's layout as a sweep: 2 learning rates x 2 seeds.
    config = config_of("nnx_ensemble")
    config.ensemble_size = 0
    config.sweep.grid.learning_rate = (0.05, 0.02)
    config.sweep.seeds = (0, 1)
    return config
  if case == "halving_ensemble":  # The sweep's layout choosing: 6 configurations, 4 slots.
    config = config_of("sweep_ensemble")
    config.ensemble_size = 4
    config.sweep.grid.learning_rate = (0.1, 0.05, 0.02)
    config.sweep.scheduler = "halving"
    config.sweep.halving.rungs = (2,)
    config.sweep.metric, config.sweep.mode = "nll", "min"
    config.eval_every_steps = 2
    return config
  if case == "lm_corpus":  # A text corpus (trainer.data.lm): 4 lanes, 2 on each process.
    config = tiny_lm_config("data_parallel", **{"model.vocab_size": 256})
    config.log_every_steps = 1
    config.eval_every_steps = 0
    config.schedule.warmup_steps = 0
    config.checkpoint.every_steps = SAVE_EVERY
    config.data.update(sources=(os.path.join(corpus_dir(), "corpus"),), tokenizer=corpus_dir(),
                       lanes=4)
    return config
  if case == "lm_fsdp":  # Every weight and its optimizer state sharded over all 8 devices.
    config = tiny_lm_config("fsdp")
    config.log_every_steps = 1
    config.eval_every_steps = 0
    config.schedule.warmup_steps = 0
    config.checkpoint.every_steps = SAVE_EVERY
    return config
  if case == "spiky_mlp":  # Regression, data x tensor parallel, the spike guard on.
    config = mlp_sharded.get_config()
    config.model.num_layers, config.model.depth, config.model.embed = 2, 16, 8
    config.batch_size = config.eval_batch_size = 16
    config.log_every_steps, config.eval_every_steps = 1, 0
    config.checkpoint.every_steps = SAVE_EVERY
    config.spikes.skip, config.spikes.window, config.spikes.warmup = True, 8, 3
    # A save that fails on one process leaves the others in orbax's barrier: the watchdog
    # ends the hang (exit 75) and the launcher restarts the job.
    config.watchdog_seconds, config.watchdog_slow_seconds = 10.0, 15.0
    return config
  if case == "grain_dp":  # Data parallel over all 8 devices: each process reads its block.
    return _image_config(**{"strategy.name": "sharded_data_parallel",
                            "strategy.mesh_shape": (8,), "strategy.mesh_axes": ("data",),
                            "strategy.logical_axis_rules": (("batch", "data"),)})
  if case == "grain_ensemble":  # 4 members x 2 devices: every process reads the whole batch.
    config = _image_config(**{"strategy.name": "sharded_ensemble"})
    config.ensemble_size = 4
    config.strategy.ensemble_mesh_shape = (4, 2)
    return config
  raise ValueError(f"unknown case {case!r}")


def elastic_strategy(case: str, num_devices: int):
  """The strategy of an elastic case on the first `num_devices` of this process's devices."""
  from strategies import ShardedDataParallel, ShardedEnsemble
  devices = jax.devices()[:num_devices]
  if case == "grain_dp":
    return ShardedDataParallel((num_devices,), ("data",), (("batch", "data"),), devices=devices)
  return ShardedEnsemble(4, (4, num_devices // 4), devices=devices)


#: The batch of `spiky_mlp` whose targets are 50x too large: the update of step SPIKE + 1.
SPIKE = 9


CASES = ("resnet_dp", "nnx_ensemble", "device_ensemble", "sweep_ensemble", "halving_ensemble",
         "lm_fsdp", "lm_corpus")

#: Where the `lm_corpus` case's files are (`corpus_files.write_corpus`), set by the test
#: before it starts the processes (they inherit the environment).
CORPUS_ENV = "FLAX_TRAINER_TEST_CORPUS"


def corpus_dir() -> str:
  return os.environ[CORPUS_ENV]

#: Cases fed by the Grain pipeline, saved on 2 processes at NUM_STEPS and resumed on one
#: process of 8 and of 4 devices to ELASTIC_STEPS (`test_multiprocess.py`).
ELASTIC_CASES = ("grain_dp", "grain_ensemble")
ELASTIC_STEPS = 8
#: Examples in the elastic cases' train split: 5 global batches of 16 an epoch, so
#: steps 6-8 read the second epoch.
NUM_EXAMPLES = 80


def trainer_of(case: str, strategy=None):
  """The case's Trainer, under the case's strategy or `strategy`."""
  import user_models

  from trainer import LanguageModelTrainer

  if case == "spiky_mlp":
    return MlpRegression(config_of(case), strategy=strategy)
  if case in ELASTIC_CASES:
    return ExampleLogTrainer(config_of(case), strategy=strategy)
  cls = {"resnet_dp": user_models.ResNetTrainer, "nnx_ensemble": user_models.NnxBatchNormTrainer,
         "device_ensemble": user_models.NnxBatchNormTrainer,
         "sweep_ensemble": user_models.NnxBatchNormTrainer,
         "halving_ensemble": user_models.NnxBatchNormTrainer,
         "lm_fsdp": LanguageModelTrainer, "lm_corpus": LanguageModelTrainer}[case]
  return cls(config_of(case), strategy=strategy)


class MlpRegression(Trainer):
  """The logical-axis MLP, mean squared error per example."""

  def build_model(self):
    return models.MLP(num_layers=self.config.model.num_layers, depth=self.config.model.depth)

  def loss(self, outputs, batch):
    return jnp.mean((outputs - batch["targets"]) ** 2, axis=-1)


class ExampleLog(nn.Module):
  """A linear classifier that records, in its `examples` collection, the training examples
  it saw: per example id how often (`count`) and at which training steps, first and last
  (`first`, `last`; 0: never). The record is model state: checkpointed, resumed. Where a
  step sees its data replica's rows, the counts are summed over `axis_name`, as
  `BatchNorm(axis_name=...)` syncs its statistics."""

  num_examples: int = NUM_EXAMPLES
  axis_name: str = "batch"

  @nn.compact
  def __call__(self, image, ids, train: bool = True):
    zeros = lambda: jnp.zeros((self.num_examples,), jnp.int32)  # noqa: E731
    t = self.variable("examples", "t", lambda: jnp.zeros((), jnp.int32))
    count = self.variable("examples", "count", zeros)
    first = self.variable("examples", "first", zeros)
    last = self.variable("examples", "last", zeros)
    if train and not self.is_initializing():
      t.value += 1
      seen = jnp.zeros((self.num_examples,), jnp.int32).at[ids].add(1)
      seen = jax.lax.psum(seen, self.axis_name)
      count.value += seen
      first.value = jnp.where((seen > 0) & (first.value == 0), t.value, first.value)
      last.value = jnp.where(seen > 0, t.value, last.value)
    return nn.Dense(10)(image.reshape((image.shape[0], -1)))


class ExampleLogTrainer(ClassificationTrainer):
  def build_model(self):
    return ExampleLog()

  def model_inputs(self, batch, *, train, rngs):
    return (batch["image"], batch["id"]), {}


def example_source() -> list[dict[str, np.ndarray]]:
  """The elastic cases' train split: NUM_EXAMPLES records with their ids (a random-access
  source, as `tfds.data_source` is)."""
  rng = np.random.default_rng(7)
  return [{"image": rng.integers(0, 256, (8, 8, 1), dtype=np.uint8),
           "label": np.int64(rng.integers(0, 10)), "id": np.int64(i)}
          for i in range(NUM_EXAMPLES)]


def example_batch(records: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {"image": np.asarray(records["image"], np.float32) / 255.0,
          "label": np.asarray(records["label"], np.int32),
          "id": np.asarray(records["id"], np.int32)}


def grain_batches(shard_rows: tuple[int, int]):
  """The Grain pipeline of the elastic cases, reading block `shard_rows` of each batch."""
  from trainer.data import pipeline
  return pipeline.GrainBatches(example_source(), batch_size=16, seed=7,
                               shard=pipeline.shard_options(shard_rows),
                               transform=example_batch, read_threads=2)


def global_batch(case: str, step: int, size: int = 16) -> dict[str, np.ndarray]:
  """Batch `step` of a case's stream, all rows."""
  rng = np.random.default_rng((7, step))
  if case == "spiky_mlp":
    batch = {"inputs": rng.normal(size=(size, 8)).astype(np.float32),
             "targets": rng.normal(size=(size, 8)).astype(np.float32)}
    batch["targets"] *= 50 if step == SPIKE else 1
    return batch
  if case == "lm_fsdp":
    from trainer.language_model import synthetic_token_batches
    return next(synthetic_token_batches(7, size, 16, 32, step))
  if case == "lm_corpus":  # Shapes (restores) and eval: synthetic tokens of the vocabulary.
    from trainer.language_model import synthetic_token_batches
    return next(synthetic_token_batches(7, size, 16, 256, step))
  if case in ELASTIC_CASES:  # Only for shapes (restores, eval): the first records.
    return example_batch({k: np.stack([r[k] for r in example_source()[:size]])
                          for k in ("image", "label", "id")})
  if case == "device_ensemble" and size == 16:  # The first batch: shapes for restores.
    return device_split().device_data(16, seed=7).example_batch()
  images = rng.random((size, 28, 28, 1), dtype=np.float32)
  return {"image": images, "label": rng.integers(0, 10, size).astype(np.int32)}


def device_split():
  """The `device_ensemble` case's train split: 40 uint8 images, the same in every process."""
  from trainer import data
  rng = np.random.default_rng(7)
  return data.Split(images=rng.integers(0, 256, (40, 28, 28, 1), dtype=np.uint8),
                    labels=rng.integers(0, 10, 40).astype(np.int32))


def train_batches(case: str, rows: slice):
  """`start_step -> batches` of this process's rows (a whole `DeviceData` split for
  `device_ensemble`: every process places all of it, each step keeps its rows)."""
  if case == "device_ensemble":
    return device_split().device_data(16, seed=7)
  if case == "lm_corpus":  # This process's lanes of the corpus.
    from trainer.data import lm
    return lm.from_config(config_of(case), rows)
  def batches(start):
    step = start
    while True:
      yield {k: v[rows] for k, v in global_batch(case, step).items()}
      step += 1
  return batches


def eval_batches(case: str) -> list[dict[str, np.ndarray]]:
  """Two global eval batches (every process passes all of them)."""
  return [global_batch(case, 10**6 + i, size=24) for i in range(2)]


def run(case: str, workdir: str, num_steps: int = NUM_STEPS, strategy=None, actions=()):
  """Trains a case with checkpoints and writers in `workdir`; returns (trainer, result)."""
  from trainer import writers
  from trainer.checkpoint import Checkpointer

  trainer = trainer_of(case, strategy)
  checkpointer = Checkpointer.from_config(trainer.config, workdir)
  writer = writers.create_writer(workdir)
  if case in ELASTIC_CASES:
    batches = grain_batches(trainer.strategy.process_rows())
  else:
    batches = train_batches(case, trainer.strategy.process_slice(trainer.config.batch_size))
  try:
    result = trainer.fit(
        batches,
        num_steps=num_steps, checkpointer=checkpointer, writer=writer, workdir=workdir,
        eval_batches=lambda: eval_batches(case), actions=actions)
  finally:
    checkpointer.close()
    writer.close()
  return trainer, result


def flat(tree) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in
          jax.tree_util.tree_leaves_with_path(tree)}


def save_result(trainer, result, out_dir: str) -> None:
  """Process 0 writes the final state (checkpoint layout) and eval; all processes gather."""
  state = flat(trainer.strategy.to_canonical(result.state))
  if jax.process_index() == 0:
    os.makedirs(out_dir, exist_ok=True)
    np.savez(os.path.join(out_dir, "state.npz"), **state)
    with open(os.path.join(out_dir, "result.json"), "w") as f:
      json.dump({"final_eval": result.final_eval, "step": result.step,
                 "stopped_by": result.stopped_by,
                 "processes": jax.process_count(), "devices": jax.device_count()}, f)
