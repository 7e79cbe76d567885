r"""Your own trainer: one Flax module and one per-example loss; the strategy is config.

    python examples/my_trainer.py
    python examples/my_trainer.py --config.strategy.name=pmap_data_parallel \
        --config.num_cpu_devices=8

A regression on synthetic data (the targets are a fixed linear map of the
inputs), so it runs anywhere in seconds and its loss falls.
"""

import os
import sys

import jax.numpy as jnp
import numpy as np

# Run from a checkout without installing: the repository root holds the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer import config as config_lib  # noqa: E402
from trainer.distributed import devices  # noqa: E402

CONFIG = config_lib.define_config_file(
    os.path.join(os.path.dirname(__file__), "..", "configs", "base.py"), "The run's config.")


class RegressionTrainer(Trainer):
  def build_model(self):  # A Linen module, or an NNX module's class.
    return models.MLP(num_layers=2, depth=16)

  def loss(self, outputs, batch):  # One loss per example: the Trainer takes the mean.
    return jnp.mean((outputs - batch["targets"]) ** 2, axis=-1)


def synthetic_batches(num: int, batch_size: int, dim: int = 16) -> list[dict[str, np.ndarray]]:
  """`num` batches whose targets are a fixed linear map of the inputs."""
  rng = np.random.default_rng(0)
  weights = (rng.normal(size=(dim, dim)) / np.sqrt(dim)).astype(np.float32)
  inputs = [rng.normal(size=(batch_size, dim)).astype(np.float32) for _ in range(num)]
  return [{"inputs": x, "targets": x @ weights} for x in inputs]


def example_batch(config) -> dict[str, np.ndarray]:
  """One batch of this program's shapes, for the dry run (`python -m trainer.plan`)."""
  return synthetic_batches(1, config.batch_size)[0]


def main(argv):
  del argv
  devices.initialize(CONFIG.value.num_cpu_devices)  # Host devices, before jax starts.
  config = CONFIG.value  # config.strategy.name picks the strategy.
  batches = synthetic_batches(100, config.batch_size)
  trainer = RegressionTrainer(config)
  result = trainer.fit(batches, num_steps=100, eval_batches=lambda: batches[:4])
  print(f"{trainer.strategy.name}: loss={result.final_eval['loss']:.4f}")


if __name__ == "__main__":
  config_lib.run(main)
