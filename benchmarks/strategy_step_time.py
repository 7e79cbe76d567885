r"""MNIST CNN train-step time under each strategy, against single_device in the same run.

    python benchmarks/strategy_step_time.py [--devices 8] [--steps 30] [--batch 128] \
        [--strategies pmap_data_parallel,...]

Batches are random MNIST-shaped arrays (the step's cost does not depend on the
values). Each strategy is compiled and warmed up, then timed over `--steps`
steps with one step queued behind the running one, as the Trainer's loop
runs. Ratios are to single_device in the same run (machines are noisy;
compare ratios). An ensemble step trains `devices` models, so its per-model
cost is also shown.
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import choices  # noqa: E402  (benchmarks/, the script's own directory)

#: The strategies timed, the baseline first.
STRATEGIES = ("single_device", "pmap_data_parallel", "sharded_data_parallel", "pmap_ensemble")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=8, help="host CPU devices to make")
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--strategies", default=",".join(STRATEGIES[1:]),
                      help="the strategies timed besides single_device (the baseline, always "
                           "timed first)")
  args = parser.parse_args()
  strategies = choices.rows(parser, "--strategies", args.strategies, STRATEGIES,
                            baseline=STRATEGIES[0])

  from trainer.distributed.devices import set_num_cpu_devices
  set_num_cpu_devices(args.devices)

  import jax
  from mnist_setup import MNISTTrainer, random_batches

  from configs import mnist_ensemble
  from strategies import Ensemble
  from trainer.evaluation import wait_for_previous_call

  batches = random_batches(args.batch)
  n = jax.device_count()
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, {n} devices, "
        f"batch {args.batch}, {args.steps} timed steps")

  rows = []
  for name in strategies:
    config = mnist_ensemble.get_config()
    config.strategy.name = name
    config.ensemble_size = n
    config.batch_size = args.batch
    config.eval_batch_size = args.batch
    trainer = MNISTTrainer(config)
    state = trainer.init_state(batches[0])
    step = trainer.strategy.compile_train_step(trainer.train_step, state)
    placed = [trainer.strategy.put_batch(b) for b in batches]
    for i in range(3):  # Compile and warm up.
      state, metrics = step(state, placed[i % len(placed)])
    jax.block_until_ready((state, metrics))
    start, outputs = time.perf_counter(), []
    for i in range(args.steps):
      state, metrics = step(state, placed[i % len(placed)])
      outputs.append(metrics)
      wait_for_previous_call(outputs)  # As Trainer.fit; more queued steps deadlock XLA:CPU.
    jax.block_until_ready((state, metrics))
    seconds = (time.perf_counter() - start) / args.steps
    members = trainer.strategy.num_members if isinstance(trainer.strategy, Ensemble) else 1
    rows.append((name, members, seconds))

  base = rows[0][2]
  print(f"{'strategy':24s} {'models':>6s} {'s/step':>9s} {'vs single':>10s} "
        f"{'s/model-step':>13s} {'vs single':>10s}")
  for name, members, seconds in rows:
    print(f"{name:24s} {members:6d} {seconds:9.4f} {seconds / base:9.2f}x "
          f"{seconds / members:13.4f} {seconds / members / base:9.2f}x")


if __name__ == "__main__":
  main()
