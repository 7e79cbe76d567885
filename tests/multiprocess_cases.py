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

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from small_configs import tiny_lm_config

import models
from configs import mlp_sharded, mnist_ensemble
from trainer import Trainer

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
    config.watchdog_seconds, config.watchdog_slow_seconds = 20.0, 40.0
    return config
  raise ValueError(f"unknown case {case!r}")


#: The batch of `spiky_mlp` whose targets are 50x too large: the update of step SPIKE + 1.
SPIKE = 9


CASES = ("resnet_dp", "nnx_ensemble", "device_ensemble", "sweep_ensemble", "halving_ensemble",
         "lm_fsdp")


def trainer_of(case: str, strategy=None):
  """The case's Trainer, under the case's strategy or `strategy`."""
  import user_models

  from trainer import LanguageModelTrainer

  if case == "spiky_mlp":
    return MlpRegression(config_of(case), strategy=strategy)
  cls = {"resnet_dp": user_models.ResNetTrainer, "nnx_ensemble": user_models.NnxBatchNormTrainer,
         "device_ensemble": user_models.NnxBatchNormTrainer,
         "sweep_ensemble": user_models.NnxBatchNormTrainer,
         "halving_ensemble": user_models.NnxBatchNormTrainer,
         "lm_fsdp": LanguageModelTrainer}[case]
  return cls(config_of(case), strategy=strategy)


class MlpRegression(Trainer):
  """The logical-axis MLP, mean squared error per example."""

  def build_model(self):
    return models.MLP(num_layers=self.config.model.num_layers, depth=self.config.model.depth)

  def loss(self, outputs, batch):
    return jnp.mean((outputs - batch["targets"]) ** 2, axis=-1)


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
  try:
    result = trainer.fit(
        train_batches(case, trainer.strategy.process_slice(trainer.config.batch_size)),
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
