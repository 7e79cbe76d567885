r"""Steps per second of `Trainer.fit` with k steps per call, host or device data, against
a hand-written `lax.scan` loop over the same step and data.

    python benchmarks/steps_per_call.py [--ks 1,4,16,64] [--models one,ensemble8] \
        [--steps 256] [--batch 128]

Models: the MNIST CNN alone (`single_device`), and an 8-member ensemble of it
on one device (`sharded_ensemble`, the members run as the platform's default
`ensemble_loop`). For each model and k:

- `fit host`: `Trainer.fit` over host batches (random MNIST-shaped float32,
  checked, stacked and placed ahead of each call, as a `data.pipeline='memory'`
  run does);
- `fit device`: `Trainer.fit` over a `DeviceData` split of 60000 uint8
  MNIST-shaped examples placed on the device once (`data.pipeline='device'`);
- `hand scan`: the limit. A jitted `lax.scan` of k calls of the Trainer's
  pure train step (`trainer.steps.train`; for the ensemble, `vmap`ped over
  the members or unrolled over them as the strategy's `ensemble_loop` is) that
  gathers each step's batch from the same device arrays in
  the same order, called in a Python loop with the state donated, nothing
  else: no metrics to the host, no non-finite check, no actions. It unrolls
  where the Trainer does (`config.steps_loop`'s platform default: unroll on
  CPU, scan elsewhere), so the two run the same program shape.

fit writes train metrics every `--log-every` steps (a real run's logging) and
checks every step's finite flag. Each figure is the best of `--repeats` timed
runs of `--steps` steps after a warm-up that compiles everything; the machine
is shared, so the ratios in the same run are the figures to compare. `fit /
scan` is fit's steps/s over the hand-written loop's for the same model, k
and (device) data; `vs k=1` is over fit with host data at k=1.
"""

import argparse
import itertools
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

NUM_EXAMPLES = 60000


def make_trainer(model: str, k: int, batch: int, log_every: int):
  from mnist_setup import MNISTTrainer

  from configs import mnist_ensemble
  config = mnist_ensemble.get_config()
  config.batch_size = config.eval_batch_size = batch
  config.log_every_steps = log_every
  config.steps_per_call = k
  if model == "one":
    config.strategy.name = "single_device"
  else:
    config.strategy.name = "sharded_ensemble"
    config.ensemble_size = int(model.removeprefix("ensemble"))
    config.strategy.ensemble_mesh_shape = (1, 1)
  return MNISTTrainer(config)


def device_split(seed: int = 0):
  import numpy as np

  from trainer import data as data_lib
  rng = np.random.default_rng(seed)
  return data_lib.Split(
      images=rng.integers(0, 256, (NUM_EXAMPLES, 28, 28, 1), dtype=np.uint8),
      labels=rng.integers(0, 10, NUM_EXAMPLES).astype(np.int32))


def fit_seconds(trainer, data, steps: int, repeats: int, writer) -> tuple[float, float]:
  """`(best seconds for `steps` steps, seconds of the warm-up call that compiled)`."""
  import jax

  from trainer.run.start import step_of
  k = trainer.runner.options.steps_per_call
  tick = time.perf_counter()
  state = jax.block_until_ready(
      trainer.fit(data, num_steps=2 * k, writer=writer).state)  # Compiles.
  warm = time.perf_counter() - tick
  best = float("inf")
  for _ in range(repeats):
    start = step_of(state, trainer.strategy)
    tick = time.perf_counter()
    state = jax.block_until_ready(
        trainer.fit(data, num_steps=start + steps, state=state, writer=writer).state)
    best = min(best, time.perf_counter() - tick)
  return best, warm


def hand_scan_seconds(trainer, split, k: int, steps: int, repeats: int) -> float:
  """The limit: a jitted scan of the pure step over device data, in a bare Python loop."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from strategies.capabilities import Ensemble
  data = split.device_data(trainer.config.batch_size, trainer.config.seed)
  state = trainer.init_state(data.example_batch())
  step_fn = trainer.steps.train
  if isinstance(trainer.strategy, Ensemble) and trainer.strategy.loop == "vmap":
    step_fn = jax.vmap(step_fn, in_axes=(0, None))
  elif isinstance(trainer.strategy, Ensemble):  # Members one after another, as the strategy.
    single = step_fn

    def step_fn(state, batch):
      outs = [single(jax.tree.map(lambda x, i=i: x[i], state), batch)
              for i in range(trainer.strategy.num_members)]
      return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)
  arrays = jax.device_put({"image": split.images, "label": split.labels})
  table = jnp.asarray(np.arange(256, dtype=np.float32) / 255.0)
  steps_per_epoch = data.steps_per_epoch
  batch = trainer.config.batch_size
  unroll = trainer.compiled._steps_loop == "unroll"

  def chunk(state, step0, orders):
    def body(state, i):
      epoch, index = jnp.divmod(step0 + i, steps_per_epoch)
      rows = jax.lax.dynamic_slice_in_dim(orders[epoch - step0 // steps_per_epoch],
                                          index * batch, batch)
      return step_fn(state, {"image": table[arrays["image"][rows]],
                             "label": arrays["label"][rows]})

    if not unroll:
      return jax.lax.scan(body, state, jnp.arange(k))
    outputs = []
    for i in range(k):  # As the Trainer unrolls: a Python loop (lax.scan keeps a loop at k=1).
      state, out = body(state, i)
      outputs.append(out)
    return state, outputs

  compiled = jax.jit(chunk, donate_argnums=0)
  orders_of = jax.jit(jax.vmap(data.permutation))
  cached = {}

  def run(state, start, num):
    for step0 in range(start, start + num, k):
      first = step0 // steps_per_epoch
      if first not in cached:  # Once per epoch, as DeviceSource does.
        cached.clear()
        cached[first] = orders_of(jnp.arange(first, first + data.epochs_per_call(k)))
      state, _ = compiled(state, jnp.int32(step0), cached[first])
    return jax.block_until_ready(state)

  state = run(state, 0, 2 * k)
  best, start = float("inf"), 2 * k
  for _ in range(repeats):
    tick = time.perf_counter()
    state = run(state, start, steps)
    best = min(best, time.perf_counter() - tick)
    start += steps
  return best


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--ks", default="1,4,16,64")
  parser.add_argument("--models", default="one,ensemble8")
  parser.add_argument("--steps", type=int, default=256,
                      help="timed steps per run (a multiple of every k)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--log-every", type=int, default=100)
  args = parser.parse_args()
  ks = [int(k) for k in args.ks.split(",")]
  if any(args.steps % k for k in ks):
    parser.error(f"--steps={args.steps} must be a multiple of every k in --ks={args.ks}")

  from trainer.distributed.devices import set_num_cpu_devices
  set_num_cpu_devices(1)
  import jax
  from mnist_setup import random_batches

  from trainer import writers
  host_batches = random_batches(args.batch)
  split = device_split()

  def host(start):
    return itertools.islice(itertools.cycle(host_batches), start % len(host_batches), None)

  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"batch {args.batch}, {args.steps} timed steps, best of {args.repeats}, fit logs "
        f"every {args.log_every} steps", flush=True)
  rows = []
  with tempfile.TemporaryDirectory() as workdir:
    writer = writers.create_writer(workdir)
    for model in args.models.split(","):
      base = None
      for k in ks:
        trainer = make_trainer(model, k, args.batch, args.log_every)
        host_s, host_warm = fit_seconds(trainer, host, args.steps, args.repeats, writer)
        trainer = make_trainer(model, k, args.batch, args.log_every)
        device = split.device_data(args.batch, trainer.config.seed)
        dev_s, dev_warm = fit_seconds(trainer, device, args.steps, args.repeats, writer)
        scan_s = hand_scan_seconds(make_trainer(model, k, args.batch, args.log_every), split,
                                   k, args.steps, args.repeats)
        base = base or host_s
        rows.append((model, k, args.steps / host_s, args.steps / dev_s, args.steps / scan_s,
                     scan_s / dev_s, base / host_s, base / dev_s, max(host_warm, dev_warm)))
        print(f"  {model} k={k}: done", flush=True)
    writer.close()

  print(f"{'model':10s} {'k':>3s} {'fit host':>10s} {'fit device':>11s} {'hand scan':>10s} "
        f"{'fit dev/scan':>12s} {'host vs k=1':>11s} {'dev vs k=1':>10s} {'warm-up s':>9s}")
  for model, k, host, dev, scan, ratio, host_up, dev_up, warm in rows:
    print(f"{model:10s} {k:3d} {host:10.1f} {dev:11.1f} {scan:10.1f} {ratio:11.3f}x "
          f"{host_up:10.2f}x {dev_up:9.2f}x {warm:9.1f}")
  print("(steps/s; 'fit dev/scan': fit with device data over the hand-written scan, 1.0 is "
        "the limit)")


if __name__ == "__main__":
  main()
