r"""MNIST CNN ensemble train-step time: jit ensembles against their pmap / single-model baselines.

    python benchmarks/ensemble_step_time.py [--steps 20] [--batch 128]

Two comparisons, each measured in the same run (ratios, since machines are noisy):

1. 8 members on 8 devices: `sharded_ensemble` (jit + shard_map, with each
   device's member looped and vectorised) against `pmap_ensemble`.
2. 4 members on ONE device: `sharded_ensemble` on a (1, 1) mesh, looped
   (`lax.map`) and vectorised (`vmap`), against 4 single-device model steps.

Batches are random MNIST-shaped arrays placed before timing; each setup is
compiled and warmed up, then timed over `--steps` steps with one step queued
behind the running one, as the Trainer's loop runs. Needs 8 devices (makes
8 host CPU devices on a CPU-only machine).
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=2,
                      help="timed rounds per setup, interleaved; the best is kept")
  parser.add_argument("--groups", default="8on8,4on1",
                      help="which comparisons: 8on8 (8 members on 8 devices), 4on1 (4 on one)")
  args = parser.parse_args()

  from trainer.distributed.devices import set_num_cpu_devices
  set_num_cpu_devices(8)

  import jax
  from mnist_setup import MNISTTrainer, random_batches

  from configs import mnist_ensemble
  from trainer.evaluation import wait_for_previous_call

  batches = random_batches(args.batch)
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} "
        f"devices, batch {args.batch}, {args.steps} timed steps, best of {args.repeats}")

  def setup(strategy, members, **strategy_fields):
    config = mnist_ensemble.get_config()
    config.strategy.name = strategy
    config.ensemble_size = members
    config.batch_size = config.eval_batch_size = args.batch
    for key, value in strategy_fields.items():
      config.strategy[key] = value
    trainer = MNISTTrainer(config)
    state = trainer.init_state(batches[0])
    step = trainer.strategy.compile_train_step(trainer.train_step, state)
    placed = [trainer.strategy.put_batch(b) for b in batches]
    for i in range(3):  # Compile and warm up.
      state, out = step(state, placed[i % len(placed)])
    jax.block_until_ready((state, out))
    return {"step": step, "state": state, "placed": placed, "best": float("inf")}

  def time_once(s):
    state = s["state"]
    start, outputs = time.perf_counter(), []
    for i in range(args.steps):
      state, out = s["step"](state, s["placed"][i % len(s["placed"])])
      outputs.append(out)
      wait_for_previous_call(outputs)  # As Trainer.fit; more queued steps deadlock XLA:CPU.
    jax.block_until_ready((state, out))
    s["state"] = state
    s["best"] = min(s["best"], (time.perf_counter() - start) / args.steps)

  groups = args.groups.split(",")
  setups = {}
  if "8on8" in groups:
    setups["pmap_ensemble 8 on 8"] = setup("pmap_ensemble", 8)
    for loop in ("map", "vmap", "unroll"):
      setups[f"sharded_ensemble 8 on 8 ({loop})"] = setup("sharded_ensemble", 8,
                                                         ensemble_loop=loop)
  if "4on1" in groups:
    setups["single_device 1 model"] = setup("single_device", 1)
    for loop in ("map", "vmap", "unroll"):
      setups[f"sharded_ensemble 4 on 1 ({loop})"] = setup(
          "sharded_ensemble", 4, ensemble_mesh_shape=(1, 1), ensemble_loop=loop)
  for _ in range(args.repeats):  # Interleaved, so drifts in machine load hit every setup.
    for s in setups.values():
      time_once(s)

  t = {name: s["best"] for name, s in setups.items()}
  print(f"\n{'setup':34s} {'s/step':>8s}  baseline")
  if "8on8" in groups:
    pmap = t["pmap_ensemble 8 on 8"]
    for name in [n for n in t if " 8 on 8" in n]:
      print(f"{name:34s} {t[name]:8.4f}  {t[name] / pmap:5.2f}x pmap_ensemble 8 on 8")
  if "4on1" in groups:
    single = t["single_device 1 model"]
    print(f"{'4 x single_device (1 model each)':34s} {4 * single:8.4f}  1.00x")
    for name in [n for n in t if " 4 on 1" in n]:
      print(f"{name:34s} {t[name]:8.4f}  {t[name] / (4 * single):5.2f}x 4 single-model steps")


if __name__ == "__main__":
  main()
