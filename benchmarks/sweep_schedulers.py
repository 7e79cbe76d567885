r"""What a sweep that chooses buys: the 16-configuration learning-rate grid of
`configs/mnist_sweep.py` on real MNIST, trained (a) as the full grid, (b) with successive
halving in 8 slots (`configs/mnist_halving.py`), (c) with population-based training over
8 members (`configs/mnist_pbt.py`), one after another in this process's machine.

    python benchmarks/sweep_schedulers.py [--epochs 1] [--manual-dir ../shared/data/mnist]

Each is `examples/mnist_ensemble.py` with its config, in a subprocess, for `--epochs`
epochs of a configuration's own (the grid's run length), evaluated on `test[:2000]`
(the choices and the reported accuracy). Printed per run: model-steps (updates that
trained a configuration, summed: frozen slots not counted), wall time (data, compile,
evaluations included) and the best member's accuracy; then halving and PBT as ratios
of the grid. A CPU figure of one selection step (the gather and placement that a
refill or a copy costs) against one train step of the 8 members comes last.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RUNS = {"grid": "configs/mnist_sweep.py", "halving": "configs/mnist_halving.py",
        "pbt": "configs/mnist_pbt.py"}


def run(name: str, workdir: str, args: argparse.Namespace) -> dict:
  command = [sys.executable, os.path.join(ROOT, "examples", "mnist_ensemble.py"),
             f"--config={os.path.join(ROOT, RUNS[name])}", f"--workdir={workdir}",
             f"--config.num_epochs={args.epochs}", "--config.data.eval_split=test[:2000]",
             f"--config.data.manual_dir={args.manual_dir}", *args.extra]
  start = time.perf_counter()
  done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
  wall = time.perf_counter() - start
  if done.returncode:
    raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
  summary = json.load(open(os.path.join(workdir, "sweep.json")))
  metric = summary["metric"]
  return {"model_steps": summary["model_steps"], "wall": wall,
          "best": summary["best"][metric], "label": summary["best"]["label"],
          "budget": summary["budget"], "trials": len({r["trial"] for r in summary["trials"]}),
          "copies": len(summary["lineage"])}


def selection_cost(repeats: int) -> tuple[float, float]:
  """Seconds of one refill + copy of 2 of 8 CNN members, and of one train step of the 8."""
  import jax

  from trainer.distributed.devices import set_num_cpu_devices
  set_num_cpu_devices(8)  # Whatever XLA_FLAGS the shell holds.
  import numpy as np

  import models
  from configs import mnist_sweep
  from trainer import ClassificationTrainer
  from trainer.sweep import schedulers
  from trainer.sweep.select import Selection

  class CNNTrainer(ClassificationTrainer):
    def build_model(self):
      return models.CNN(num_classes=10)

  config = mnist_sweep.get_config()
  config.sweep.seeds, config.sweep.scheduler = (0,), "halving"
  config.ensemble_size, config.data.pipeline, config.steps_per_call = 8, "memory", 1
  config.eval_every_steps = 36
  config.sweep.grid.learning_rate = tuple(config.sweep.grid.learning_rate) * 2
  trainer = CNNTrainer(config, num_train_steps=100)
  rng = np.random.default_rng(0)
  batch = {"image": rng.random((config.batch_size, 28, 28, 1), np.float32),
           "label": rng.integers(0, 10, config.batch_size).astype(np.int32)}
  state = trainer.init_state(batch)
  step = trainer.compiled.train(state)
  placed = trainer.strategy.put_batch(batch)
  state, _ = step(state, placed)
  jax.block_until_ready(state)
  train = []
  for _ in range(repeats):
    t = time.perf_counter()
    state, _ = step(state, placed)
    jax.block_until_ready(state)
    train.append(time.perf_counter() - t)
  scheduler = schedulers.create(config, trainer.sweep, slots=8, budget=100)
  selection = Selection(scheduler, init_members=trainer.states.init_members)
  chosen = []
  for i in range(repeats + 1):
    scheduler.slots, scheduler.start = list(range(8)), [0] * 8
    scheduler.next_trial = 8
    scheduler.recorded = [{} for _ in scheduler.rungs]
    values = list(rng.random(8))
    t = time.perf_counter()
    state, decision = selection.choose(state, 36, values, last=False)
    jax.block_until_ready(state)
    if i:  # The first compiles the gather and the fresh members' init.
      chosen.append(time.perf_counter() - t)
  return float(np.median(chosen)), float(np.median(train))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--epochs", type=int, default=1)
  parser.add_argument("--manual-dir", default=os.path.join(ROOT, "..", "shared", "data",
                                                           "mnist"))
  parser.add_argument("--runs", default="grid,halving,pbt")
  parser.add_argument("--selection-repeats", type=int, default=5)
  args, args.extra = parser.parse_known_args()  # The rest: --config.* flags for every run.
  bad = [a for a in args.extra if not a.startswith("--config.")]
  if bad:
    parser.error(f"unrecognized arguments: {bad} (only --config.* flags pass to the runs)")
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    for name in args.runs.split(","):
      results[name] = run(name, os.path.join(tmp, name), args)
      r = results[name]
      print(f"{name:8s} model-steps {r['model_steps']:7d}  wall {r['wall']:7.1f} s  "
            f"best accuracy {r['best']:.4f} ({r['label']}); {r['trials']} configurations"
            + (f", {r['copies']} copies" if name == "pbt" else ""), flush=True)
  if "grid" in results:
    grid = results["grid"]
    for name in [n for n in results if n != "grid"]:
      r = results[name]
      points = 100 * (r["best"] - grid["best"])
      print(f"{name} / grid: model-steps {r['model_steps'] / grid['model_steps']:.2f}x, wall "
            f"{r['wall'] / grid['wall']:.2f}x, best accuracy {points:+.2f} points")
  chosen, train = selection_cost(args.selection_repeats)
  print(f"selection step (refill 6 of 8 CNN members from their seeds): {1000 * chosen:.1f} ms; "
        f"one train step of the 8: {1000 * train:.1f} ms; ratio {chosen / train:.2f}")


if __name__ == "__main__":
  main()
