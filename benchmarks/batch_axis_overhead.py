r"""What binding `strategies.BATCH_AXIS` as a size-1 `vmap` costs a train step.

    python benchmarks/batch_axis_overhead.py [--pairs 20] [--block-seconds 1.0] [--batch 128]

Strategies whose step sees the whole batch (`single_device`,
`sharded_data_parallel`, `pmap_ensemble`) call the model inside a size-1
`vmap` named `batch`, so a model written with `BatchNorm(axis_name='batch')`
runs unchanged. The baseline is the same Trainer with the model called
directly (`bind_batch_axis` replaced by a plain call), which only a model that
names no axis can use: the MNIST CNN. Each strategy's two compiled steps
alternate in `--pairs` pairs of blocks of equal step counts; the figure is the
median per-pair ratio bound / direct with its interquartile range.
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STRATEGIES = ("single_device", "sharded_data_parallel", "pmap_ensemble")


def _steps_per_block(step, state, batch, seconds):
  import jax
  state, out = step(state, batch)
  jax.block_until_ready(out)
  n, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    state, out = step(state, batch)
    jax.block_until_ready(out)
    n += 1
  return max(n, 8), state


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--pairs", type=int, default=20)
  parser.add_argument("--block-seconds", type=float, default=1.0)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--strategies", default=",".join(STRATEGIES))
  args = parser.parse_args()
  from trainer.distributed.devices import set_num_cpu_devices
  set_num_cpu_devices(args.devices)
  import jax
  from mnist_setup import MNISTTrainer, random_batches, timed_block

  from configs import mnist_ensemble

  class Direct(MNISTTrainer):
    def apply_model(self, params, model_state, batch, *, rngs, train):
      inputs = self.model_inputs(batch, train=train, rngs=rngs)
      return self.model_variables.apply(params, model_state, inputs, rngs=rngs, train=train)

  print(f"{jax.device_count()} {jax.devices()[0].platform} devices, MNIST CNN, batch "
        f"{args.batch}, {args.pairs} pairs")
  print(f"{'strategy':<24} {'bound s/step':>12} {'direct s/step':>13} {'bound/direct':>12} "
        f"{'middle half':>14}")
  for name in args.strategies.split(","):
    config = mnist_ensemble.get_config()
    config.strategy.name = name
    config.batch_size = args.batch
    if name == "sharded_data_parallel":
      config.strategy.mesh_shape, config.strategy.mesh_axes = (-1,), ("data",)
      config.strategy.logical_axis_rules = (("batch", "data"),)
    runs = {}
    for label, cls in (("bound", MNISTTrainer), ("direct", Direct)):
      trainer = cls(config)
      batch = random_batches(args.batch, num=1)[0]
      state = trainer.init_state(batch)
      placed = trainer.strategy.put_batch(batch)
      runs[label] = [trainer.compiled.train(state), state, placed]
    steps, runs["bound"][1] = _steps_per_block(*runs["bound"], args.block_seconds)
    ratios, times = [], {"bound": [], "direct": []}
    for pair in range(args.pairs):
      order = ("bound", "direct") if pair % 2 == 0 else ("direct", "bound")
      seconds = {}
      for label in order:
        step, state, placed = runs[label]
        seconds[label], runs[label][1] = timed_block(step, state, placed, steps)
        times[label].append(seconds[label] / steps)
      ratios.append(seconds["bound"] / seconds["direct"])
    q = statistics.quantiles(ratios, n=4)
    print(f"{name:<24} {statistics.median(times['bound']):12.4f} "
          f"{statistics.median(times['direct']):13.4f} {statistics.median(ratios):11.3f}x "
          f"{q[0]:6.3f}-{q[2]:.3f}")


if __name__ == "__main__":
  main()
