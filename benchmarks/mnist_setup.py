"""What the MNIST benchmarks share: the CNN trainer and random MNIST-shaped batches.

Import it after the host device count is set: it imports jax.
"""

import numpy as np

import models
from trainer import ClassificationTrainer


class MNISTTrainer(ClassificationTrainer):
  def build_model(self):
    return models.CNN(num_classes=10)


def random_batches(batch_size: int, num: int = 4, seed: int = 0) -> list[dict[str, np.ndarray]]:
  """MNIST-shaped batches of random values (a train step's cost does not depend on them)."""
  rng = np.random.default_rng(seed)
  return [{"image": rng.random((batch_size, 28, 28, 1), dtype=np.float32),
           "label": rng.integers(0, 10, batch_size).astype(np.int32)} for _ in range(num)]
