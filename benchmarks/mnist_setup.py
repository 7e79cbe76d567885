"""What the benchmarks share: the MNIST CNN trainer, random MNIST-shaped batches, a step timer.

Import it after the host device count is set: it imports jax.
"""

import time

import jax
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


def timed_block(step, state, batch, steps: int):
  """`(seconds, state)` of `steps` calls of a compiled train step, one queued behind the
  running one as `Trainer.fit` keeps them (more queued calls deadlock XLA:CPU)."""
  start = time.perf_counter()
  outputs = []
  for _ in range(steps):
    state, out = step(state, batch)
    outputs.append(out)
    if len(outputs) > 1:
      jax.block_until_ready(outputs[-2])
      outputs.pop(0)
  jax.block_until_ready(outputs)
  return time.perf_counter() - start, state
