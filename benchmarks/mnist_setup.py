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


def compiled_run(trainer, batch, *, aot: bool = True) -> tuple[list, float]:
  """`([compiled step, state, placed batch], XLA temp MiB)` of `trainer`'s train step, warmed
  up; compiled once, so the program timed is the one asked for its memory.

  `aot=False` times the jitted step instead (the same program, through jit's dispatch): on
  XLA:CPU a compiled program takes 4-bit arguments packed, which CPU buffers are not, and
  only jit's dispatch converts them (a QLoRA state's codes)."""
  state = trainer.init_state(batch)
  placed = trainer.strategy.put_batch(batch)
  jitted = trainer.compiled.train(state)
  step = jitted.lower(state, placed).compile()
  temp = getattr(step.memory_analysis(), "temp_size_in_bytes", float("nan")) / 2**20
  step = step if aot else jitted
  _, state = timed_block(step, state, placed, 2)
  return [step, state, placed], temp


def rotating_rounds(runs: dict, baseline: str, *, rounds: int, block_seconds: float,
                    min_steps: int) -> dict[str, list[float]]:
  """Seconds per step of each run in `runs` (name -> `compiled_run`'s list, whose state is
  carried on), over `rounds` rounds of equal step blocks, the order rotating each round;
  a block is as many steps as `baseline` runs in `block_seconds` (at least `min_steps`)."""
  names = list(runs)
  start, n = time.perf_counter(), 0
  while time.perf_counter() - start < block_seconds or n < min_steps:
    _, runs[baseline][1] = timed_block(*runs[baseline], 1)
    n += 1
  times = {v: [] for v in names}
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      seconds, runs[name][1] = timed_block(*runs[name], n)
      times[name].append(seconds / n)
  return times
