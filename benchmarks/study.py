r"""An Optuna study inside one compiled program, against Optuna's own loop around separate runs,
and the grid with successive halving of the same budget: the MNIST CNN on real MNIST.

    python benchmarks/study.py [--trials 32] [--slots 8] [--steps 468] \
        [--manual-dir ../shared/data/mnist]

The same search space (learning rate log-uniform in [0.003, 0.5], momentum in
[0, 0.95], weight decay log-uniform in [1e-6, 1e-3]; SGD), the same TPE sampler
seeded by `config.seed` (each trial's draws seeded by its number:
`trainer.sweep.study.trial_seeded`), the same median pruner (after 4 trials, from
a trial's 72nd step), `--trials` trials of at most `--steps` steps each (468: one
epoch at batch 128), every trial reporting its accuracy on `test[:2000]` every 36
of its own steps:

- `optimize`: Optuna's loop as its documentation writes it, `study.optimize(objective,
  n_trials=...)`, whose objective trains one CNN with this project's `single_device`
  trainer, reports each evaluation (`trial.report`) and raises `optuna.TrialPruned`
  when `trial.should_prune()`;
- `program`: `configs/mnist_study.py`, the study inside one program whose `--slots`
  ensemble slots are its concurrent trials (`examples/mnist_ensemble.py`);
- `grid`: a 32-point grid of the same space (4 rates x 2 momenta x 2 decays x ...)
  under this project's successive halving in `--slots` slots, each trial at most
  `--steps` steps, rungs at 72 and 288 steps (`configs/mnist_halving.py`'s kind).

Each runs in its own process, one after another, with the persistent compilation
cache off. Printed per run: wall time (start-up, data, compilation and evaluations
included), model-steps (updates that trained a trial, summed) and the best trial's
accuracy; then each against `optimize` as ratios. Run the same command on a GPU host:
the ensemble's slots then share one accelerator's width.
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

SPACE = {"learning_rate": ("log", 0.003, 0.5), "momentum": ("float", 0.0, 0.95),
         "weight_decay": ("log", 1e-6, 1e-3)}
GRID = {"learning_rate": (0.005, 0.02, 0.08, 0.3), "momentum": (0.0, 0.9),
        "weight_decay": (1e-6, 1e-4), "seeds": (0, 1)}


def common_flags(args: argparse.Namespace) -> list[str]:
  return [f"--config.num_train_steps={args.steps}", f"--config.data.manual_dir={args.manual_dir}",
          f"--config.eval_every_steps={args.eval_every}",
          f"--config.sweep.halving.min_steps={2 * args.eval_every}",
          f"--config.ensemble_size={args.slots}", "--config.log_every_steps=100000",
          f"--config.steps_per_call={args.steps_per_call}", *args.extra]


def run_program(name: str, workdir: str, args: argparse.Namespace) -> dict:
  flags = [f"--config={os.path.join(ROOT, 'configs', 'mnist_study.py')}",
           f"--config.sweep.study.n_trials={args.trials}"]
  if name == "grid":  # The same space as a grid, successive halving choosing.
    flags += [f"--config.sweep.study.space.{n}=()" for n in SPACE]
    flags += [f"--config.sweep.grid.{n}={v!r}" for n, v in GRID.items() if n != "seeds"]
    flags += [f"--config.sweep.seeds={GRID['seeds']!r}"]
    flags += ["--config.sweep.scheduler=halving", "--config.sweep.halving.reduction_factor=4"]
  # On a CPU-only host one device per slot (no effect on GPU/TPU hosts).
  flags += [f"--config.num_cpu_devices={args.slots}"]
  command = [sys.executable, os.path.join(ROOT, "examples", "mnist_ensemble.py"),
             f"--workdir={workdir}", *flags, *common_flags(args)]
  start = time.perf_counter()
  done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=_env())
  wall = time.perf_counter() - start
  if done.returncode:
    raise SystemExit(f"{name} failed:\n{done.stderr[-4000:]}")
  summary = json.load(open(os.path.join(workdir, "sweep.json")))
  best = max((r["curve"][-1][2] for r in summary["trials"]
              if r["status"] == "completed" and r["curve"]), default=float("nan"))
  return {"wall": wall, "model_steps": summary["model_steps"], "best": best,
          "trials": len({r["trial"] for r in summary["trials"]}),
          "pruned": sum(r["status"] == "stopped" for r in summary["trials"])}


KEEP_CACHE = False  # --keep-cache: the environment's persistent compilation cache stays on.


def _env() -> dict:
  env = dict(os.environ)
  if not KEEP_CACHE:  # As a first run on a machine: every program compiles.
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  return env


def run_optimize(workdir: str, args: argparse.Namespace) -> dict:
  command = [sys.executable, os.path.abspath(__file__), "--child", f"--workdir={workdir}",
             f"--trials={args.trials}", f"--steps={args.steps}",
             f"--eval-every={args.eval_every}", f"--steps-per-call={args.steps_per_call}",
             f"--slots={args.slots}", f"--manual-dir={args.manual_dir}", *args.extra]
  start = time.perf_counter()
  done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=_env())
  wall = time.perf_counter() - start
  if done.returncode:
    raise SystemExit(f"optimize failed:\n{done.stderr[-4000:]}")
  return {"wall": wall, **json.load(open(os.path.join(workdir, "optimize.json")))}


def child(args: argparse.Namespace) -> None:
  """Optuna's own loop: `study.optimize`, one single-device run per trial."""
  import ast

  from trainer.distributed import devices
  devices.initialize(1)
  import optuna
  from absl import logging

  import models
  from configs import mnist_study
  from trainer import Action, ClassificationTrainer, Produced, data
  from trainer.sweep import study as study_lib

  class CNNTrainer(ClassificationTrainer):
    def build_model(self):
      return models.CNN(num_classes=10)

  logging.set_verbosity(logging.WARNING)
  base = mnist_study.get_config()
  for flag in common_flags(args):  # The runs' --config.* flags, as the example reads them.
    name, value = flag.removeprefix("--config.").split("=", 1)
    try:
      value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      pass
    base.update_from_flattened_dict({name: value})
  d = base.data
  builder = data.prepare(d.name, d.data_dir, d.manual_dir)
  train = data.load_split(builder, d.train_split)
  test = data.load_split(builder, d.eval_split)
  model_steps = 0

  class Report(Action):
    """Reports each evaluation to the trial; stops the run when the pruner says so."""

    def __init__(self, trial):
      super().__init__(every_steps=base.eval_every_steps)
      self.trial, self.pruned = trial, False

    def run(self, view):
      self.trial.report(view.eval_results[base.sweep.metric], view.step)
      if self.trial.should_prune():
        self.pruned = True
        return Produced(stop="pruned")
      return None

  def objective(trial: optuna.Trial) -> float:
    nonlocal model_steps
    config = base.copy_and_resolve_references()
    for name, (kind, low, high) in SPACE.items():
      config[name] = trial.suggest_float(name, low, high, log=kind == "log")
      config.sweep.study.space[name] = ()
    config.strategy.name, config.ensemble_size = "single_device", 0
    trainer = CNNTrainer(config, num_train_steps=args.steps)
    report = Report(trial)
    result = trainer.fit(train.device_data(config.batch_size, config.seed),
                         num_steps=args.steps, actions=[report],
                         eval_batches=lambda: data.eval_batches(test, config.eval_batch_size))
    model_steps += result.step
    if report.pruned:
      raise optuna.TrialPruned()
    return result.final_eval[base.sweep.metric]

  optuna.logging.set_verbosity(optuna.logging.WARNING)
  study = optuna.create_study(direction="maximize",
                              sampler=study_lib.trial_seeded("tpe", base.seed),
                              pruner=study_lib.make_pruner(base, args.steps))
  study.optimize(objective, n_trials=args.trials)
  states = [t.state.name for t in study.trials]
  with open(os.path.join(args.workdir, "optimize.json"), "w") as f:
    json.dump({"model_steps": model_steps, "best": study.best_value,
               "trials": len(study.trials), "pruned": states.count("PRUNED")}, f)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--trials", type=int, default=32)
  parser.add_argument("--slots", type=int, default=8)
  parser.add_argument("--steps", type=int, default=468)
  parser.add_argument("--eval-every", type=int, default=36)
  parser.add_argument("--steps-per-call", type=int, default=4)
  parser.add_argument("--manual-dir", default=os.path.join(ROOT, "..", "shared", "data",
                                                           "mnist"))
  parser.add_argument("--runs", default="optimize,program,grid")
  parser.add_argument("--keep-cache", action="store_true",
                      help="keep the environment's persistent compilation cache (the runs "
                           "then compile only what it lacks)")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--workdir", help=argparse.SUPPRESS)
  args, args.extra = parser.parse_known_args()  # The rest: --config.* flags for every run.
  bad = [a for a in args.extra if not a.startswith("--config.")]
  if bad:
    parser.error(f"unrecognized arguments: {bad} (only --config.* flags pass to the runs)")
  if args.child:
    child(args)
    return
  global KEEP_CACHE
  KEEP_CACHE = args.keep_cache
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    for name in args.runs.split(","):
      workdir = os.path.join(tmp, name)
      os.makedirs(workdir)
      results[name] = (run_optimize(workdir, args) if name == "optimize"
                       else run_program(name, workdir, args))
      r = results[name]
      print(f"{name:9s} wall {r['wall']:7.1f} s  model-steps {r['model_steps']:7d}  best "
            f"accuracy {r['best']:.4f}  trials {r['trials']} ({r['pruned']} pruned)",
            flush=True)
  if "optimize" in results:
    base = results["optimize"]
    for name in [n for n in results if n != "optimize"]:
      r = results[name]
      print(f"{name} / optimize: wall {r['wall'] / base['wall']:.2f}x, model-steps "
            f"{r['model_steps'] / base['model_steps']:.2f}x, best accuracy "
            f"{100 * (r['best'] - base['best']):+.2f} points")


if __name__ == "__main__":
  main()
