r"""A sweep of N learning rates trained as one ensemble, against N separate single-model runs.

    python benchmarks/sweep_vs_runs.py [--members 8] [--steps 50] [--batch 32]

Both train the MNIST CNN for `--steps` steps on the same host batches, with
the members' learning rates log-spaced over [0.001, 0.1] and seed 0:

- `sweep`: one `Trainer` under `sharded_ensemble` with `config.sweep`, the
  members spread over `--devices` devices (several per device run as the
  platform's `ensemble_loop`), one `fit`: one compilation;
- `separate`: N `Trainer`s under `single_device` on the first device, one
  after another, each with its member's config (`Sweep.member_config`), each
  compiling its own step, as N separate jobs on that hardware would.

On a CPU-only machine `--devices 8` makes 8 host devices sharing the same
cores (what a CPU run of `configs/mnist_sweep.py` does); on a GPU host keep
1 for one GPU.

Printed: total wall time of each including compilation, time per model-step
after the first (compiling) call, and the ratios separate / sweep (above 1:
the sweep is faster). No persistent compilation cache is used.
"""

import argparse
import itertools
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def config_for(members: int, batch: int, steps: int, devices: int):
  import numpy as np

  from configs import mnist_ensemble
  config = mnist_ensemble.get_config()
  config.batch_size = config.eval_batch_size = batch
  config.num_train_steps = steps
  config.log_every_steps = steps
  config.ensemble_size = 0
  config.strategy.name = "sharded_ensemble"
  config.strategy.ensemble_mesh_shape = (devices, 1)
  config.sweep.grid.learning_rate = tuple(float(x) for x in np.geomspace(1e-3, 0.1, members))
  return config


def timed_fit(trainer, batches, steps: int) -> tuple[float, float]:
  """`(total seconds, seconds per step after the first call)` of one fit from scratch."""
  import jax
  tick = time.perf_counter()
  state = jax.block_until_ready(trainer.fit(batches, num_steps=1).state)  # Compiles.
  first = time.perf_counter()
  jax.block_until_ready(trainer.fit(batches, num_steps=steps, state=state).state)
  end = time.perf_counter()
  return end - tick, (end - first) / (steps - 1)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--members", type=int, default=8)
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--devices", type=int, default=1,
                      help="devices the sweep spreads its members over (host CPU devices made "
                           "on a CPU-only machine); each separate run uses the first")
  args = parser.parse_args()

  from trainer.distributed.devices import set_num_cpu_devices
  set_num_cpu_devices(args.devices)
  import jax
  from mnist_setup import MNISTTrainer, random_batches

  from strategies.single_device import SingleDevice
  batches = random_batches(args.batch)

  def stream(start):
    return itertools.islice(itertools.cycle(batches), start % len(batches), None)

  config = config_for(args.members, args.batch, args.steps, args.devices)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"{args.members} members, {args.steps} steps, batch {args.batch}", flush=True)
  sweep_trainer = MNISTTrainer(config)
  sweep_total, sweep_step = timed_fit(sweep_trainer, stream, args.steps)
  print(f"  sweep: done ({sweep_trainer.strategy.describe()})", flush=True)
  separate_total = separate_step = 0.0
  for i in range(args.members):
    member = sweep_trainer.sweep.member_config(config, i)
    total, step = timed_fit(MNISTTrainer(member, strategy=SingleDevice()), stream, args.steps)
    separate_total, separate_step = separate_total + total, separate_step + step
  print("  separate runs: done", flush=True)
  n = args.members
  print(f"{'':10s} {'wall s (with compile)':>22s} {'s per model-step':>17s}")
  print(f"{'sweep':10s} {sweep_total:22.2f} {sweep_step / n:17.5f}")
  print(f"{'separate':10s} {separate_total:22.2f} {separate_step / n:17.5f}")
  print(f"{'ratio':10s} {separate_total / sweep_total:21.2f}x {separate_step / sweep_step:16.2f}x"
        "   (separate / sweep: above 1, the sweep is faster)")


if __name__ == "__main__":
  main()
