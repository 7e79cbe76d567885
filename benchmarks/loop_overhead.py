r"""What `Trainer.fit` costs on top of its own compiled train step, for every strategy.

    python benchmarks/loop_overhead.py [--pairs 30] [--block-seconds 1.5] [--batch 128]

For each strategy, the baseline is a bare loop that calls the Trainer's own
compiled train step on `strategy.put_batch(batch)`, keeping one step queued
behind the running one as `fit` does (`trainer.trainer.wait_for_previous_call`:
with no bound, back-to-back steps with collectives deadlock XLA:CPU's fake
devices; seen here in this benchmark under `sharded_data_parallel`);
`fit` runs the same number of steps over the same host batches with
everything a real run has except evaluation and checkpoints: the non-finite
check, train metrics merged and written every `--log-every` steps to real
TensorBoard / `metrics.jsonl` writers, progress lines, the per-step batch
checks. The two alternate in `--pairs` pairs of blocks in the same process
(which one goes first alternates too); a block has as many steps as the bare
loop runs in about `--block-seconds` (at least 8), so every strategy gets the
same number of pairs. `fit` is called once per block, so its start and end
(and a log at the end of every block) count against it more than in a real
run. The figure is the median of the per-pair ratios fit / bare, with their
interquartile range: on a shared 2-core machine single pairs vary by +-5%.
Batches are random MNIST-shaped arrays; the model is the MNIST CNN. Ensembles
have one member per device.
"""

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STRATEGIES = ("single_device", "pmap_data_parallel", "sharded_data_parallel", "pmap_ensemble",
              "sharded_ensemble")


def measure(trainer, batches, block_seconds: float, pairs: int) -> dict[str, list[float]]:
  """Seconds per step of `pairs` bare-loop blocks and `pairs` fit blocks, interleaved."""
  import jax

  from trainer import writers
  from trainer.evaluation import wait_for_previous_call
  from trainer.run.start import step_of

  def stream(start):
    return itertools.islice(itertools.cycle(batches), start % len(batches), None)

  state = trainer.init_state(batches[0])
  step_fn = trainer.compiled.train(state)
  put = trainer.strategy.put_batch

  def bare(state, steps):
    outputs = []
    for batch in itertools.islice(stream(0), steps):
      state, out = step_fn(state, put(batch))
      outputs.append(out)
      wait_for_previous_call(outputs)  # As fit: more queued steps deadlock XLA:CPU.
    return jax.block_until_ready(state)

  times = {"bare": [], "fit": []}
  with tempfile.TemporaryDirectory() as workdir:
    writer = writers.create_writer(workdir)  # Real TensorBoard and metrics.jsonl files.

    def fit(state, steps):
      start = step_of(state, trainer.strategy)
      return jax.block_until_ready(
          trainer.fit(stream, num_steps=start + steps, state=state, writer=writer).state)

    state = fit(bare(state, 3), 3)  # Compiles every step function and warms both loops up.
    tick = time.perf_counter()
    state = bare(state, 5)
    steps = max(8, round(block_seconds / ((time.perf_counter() - tick) / 5)))
    for pair in range(pairs):
      for which in (("bare", "fit") if pair % 2 == 0 else ("fit", "bare")):
        tick = time.perf_counter()
        state = (bare if which == "bare" else fit)(state, steps)
        times[which].append((time.perf_counter() - tick) / steps)
    writer.close()
  return times


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=8, help="host CPU devices to make")
  parser.add_argument("--block-seconds", type=float, default=1.5,
                      help="about how long one timed block runs")
  parser.add_argument("--pairs", type=int, default=30, help="pairs of (bare, fit) blocks")
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--log-every", type=int, default=20,
                      help="fit's log_every_steps (the MNIST config's is 100)")
  parser.add_argument("--strategies", default=",".join(STRATEGIES))
  args = parser.parse_args()

  from trainer.distributed.devices import set_num_cpu_devices
  set_num_cpu_devices(args.devices)

  import jax
  from mnist_setup import MNISTTrainer, random_batches

  from configs import mnist_ensemble

  batches = random_batches(args.batch)
  n = jax.device_count()
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, {n} devices, batch "
        f"{args.batch}, {args.pairs} pairs of ~{args.block_seconds} s blocks, fit logs every "
        f"{args.log_every} steps and at the end of each block")

  rows = []
  for name in args.strategies.split(","):
    config = mnist_ensemble.get_config()
    config.strategy.name = name
    config.ensemble_size = n
    config.batch_size = config.eval_batch_size = args.batch
    config.log_every_steps = args.log_every
    times = measure(MNISTTrainer(config), batches, args.block_seconds, args.pairs)
    ratios = [f / b for f, b in zip(times["fit"], times["bare"], strict=True)]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    rows.append((name, statistics.median(times["bare"]), statistics.median(times["fit"]),
                 statistics.median(ratios), quartiles[0], quartiles[-1]))
    print(f"  {name}: done", flush=True)

  print(f"{'strategy':24s} {'bare s/step':>11s} {'fit s/step':>11s} {'fit/bare':>9s} "
        f"{'middle half of pairs':>21s}")
  for name, bare_s, fit_s, ratio, lo, hi in rows:
    print(f"{name:24s} {bare_s:11.4f} {fit_s:11.4f} {ratio:8.3f}x {f'{lo:.3f}-{hi:.3f}':>21s}")


if __name__ == "__main__":
  main()
