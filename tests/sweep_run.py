"""A sweep with a scheduler and checkpoints, for tests that kill a real process.

    python tests/sweep_run.py --workdir=W --scheduler=halving --out=final.npz \
        [--kill_after_save_at=2] [--kill_after_choices_at=4] [--storage=PATH] [--save_at=2]

Trains `FlaxStyleTrainer` (BatchNorm, dropout) on the test images under
`pmap_ensemble`, resuming from `W/checkpoints` when it holds one, and writes
the final state (checkpoint layout) to `--out`; the sweep's summary is in
`W/sweep.json`. `--kill_after_save_at=S` SIGKILLs the process once the
checkpoint of step S is complete (after that evaluation's choices);
`--kill_after_choices_at=S` once that evaluation's choices are made, before its
checkpoint (a restart replays them); `--save_at=S,...` checkpoints those steps only.
`--scheduler=study` asks an Optuna study
(in W, or the journal file `--storage`, which several runs may share).
"""

import argparse
import logging
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import conftest  # noqa: E402 -- sets the 8 fake devices before jax starts.
import numpy as np  # noqa: E402
from resume_run import flat  # noqa: E402
from user_models import FlaxStyleTrainer  # noqa: E402

from trainer import Action  # noqa: E402
from trainer.checkpoint import Checkpointer  # noqa: E402

SCHEDULERS = {
    "halving": {"sweep.scheduler": "halving", "sweep.halving.rungs": (2, 4),
                "sweep.grid.learning_rate": (0.3, 0.1, 0.03, 0.01, 0.003, 0.001),
                "sweep.seeds": (0, 1), "ensemble_size": 8},
    "pbt": {"sweep.scheduler": "pbt", "sweep.pbt.ready_steps": 2,
            "sweep.grid.learning_rate": (0.3, 0.1, 0.03, 0.01), "sweep.seeds": (0, 1),
            "ensemble_size": 0},
    "study": {"strategy.name": "sharded_ensemble", "strategy.ensemble_mesh_shape": (4, 1),
              "ensemble_size": 4, "optimizer": "sgd",
              "sweep.study.space.learning_rate": ("log", 0.001, 0.3),
              "sweep.study.space.momentum": ("float", 0.0, 0.95),
              "sweep.study.n_trials": 10, "sweep.study.pruner": "halving",
              "sweep.halving.rungs": (2, 4)},
}


class KillAfterChoices(Action):
  """Dies by SIGKILL after the sweep's choices at one step (before its checkpoint), once
  the checkpoints before it are complete (so the restart resumes from the last of them)."""

  def __init__(self, step, checkpointer):
    super().__init__(every_steps=2)
    self.step, self.checkpointer = step, checkpointer

  def run(self, view):
    if view.step == self.step:
      self.checkpointer.wait()
      os.kill(os.getpid(), signal.SIGKILL)


def fit_killed(trainer, batches, *, num_steps: int, workdir: str, kill_at: int = -1,
               kill_after_save_at: int = -1, every_steps: int = 4):
  """`trainer.fit` checkpointing every `every_steps` in `workdir/checkpoints` (resuming from
  it), SIGKILLed once step `kill_at` is done (between checkpoints: its state computed) or
  once the checkpoint of step `kill_after_save_at` is complete; returns the fit's result."""
  import jax

  from trainer.loop.actions import PeriodicCallback
  checkpointer = KillingCheckpointer(os.path.join(workdir, "checkpoints"),
                                     every_steps=every_steps, async_save=False)
  checkpointer.kill_at = kill_after_save_at

  def kill(view):
    if view.step == kill_at:
      jax.block_until_ready(view.state)  # Step S is done (and anything it logs, logged).
      os.kill(os.getpid(), signal.SIGKILL)

  try:
    return trainer.fit(batches, num_steps=num_steps, checkpointer=checkpointer,
                       workdir=workdir,
                       actions=[PeriodicCallback(kill, every_steps=1, reads_state=True)])
  finally:
    checkpointer.close()


def killed_run_main(run, **extra: str) -> None:
  """The entry point of a resume-test script: `--workdir`, `--out`, `--kill_at`,
  `--kill_after_save_at` and the `extra` flags (name -> help) parsed, logging quieted;
  `run(args) -> (trainer, result)` trains (by `fit_killed`); the final state (checkpoint
  layout) is written to `--out`."""
  parser = argparse.ArgumentParser()
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--kill_at", type=int, default=-1)
  parser.add_argument("--kill_after_save_at", type=int, default=-1)
  for name, text in extra.items():
    parser.add_argument(f"--{name}", required=True, help=text)
  args = parser.parse_args()
  logging.getLogger().setLevel(logging.INFO)
  for noisy in ("absl", "jax", "orbax"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  trainer, result = run(args)
  np.savez(args.out, **flat(trainer.strategy.checkpoint_state(result.state)))
  print(f"finished at step {result.step}", flush=True)


def killed_and_resumed(run, tmp_path) -> dict:
  """What the SIGKILL resume tests check, for a script `run(workdir, out, *flags) ->
  CompletedProcess` that `killed_run_main` drives: killed right after the checkpoint of
  step 4, then at step 7 (between checkpoints every 4), then run to its end, each time
  resuming, its final state equals an uninterrupted run's bit for bit; returns that state."""
  straight = run(tmp_path / "straight", tmp_path / "straight.npz")
  assert straight.returncode == 0, straight.stderr[-3000:]
  work, out = tmp_path / "work", tmp_path / "final.npz"
  for kill, kill_at, resumed_at in [("kill_after_save_at", 4, 0), ("kill_at", 7, 4),
                                    ("kill_at", -1, 4)]:
    attempt = run(work, out, f"--{kill}={kill_at}")
    assert attempt.returncode == (-signal.SIGKILL if kill_at > 0 else 0), \
        attempt.stderr[-3000:]
    if resumed_at:
      assert f"Resuming at step {resumed_at}" in attempt.stderr
  a, b = np.load(tmp_path / "straight.npz"), np.load(out)
  assert sorted(a) == sorted(b)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)  # Bit for bit.
  return dict(a)


class KillingCheckpointer(Checkpointer):
  """Dies by SIGKILL once the save of one step is complete."""

  kill_at: int = -1
  #: The only steps saved (empty: every one the run asks for).
  save_at: tuple[int, ...] = ()

  def save(self, step, state, layout, **kwargs):
    if self.save_at and step not in self.save_at:
      return
    super().save(step, state, layout, **kwargs)
    if step == self.kill_at:
      self.wait()
      os.kill(os.getpid(), signal.SIGKILL)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--scheduler", choices=sorted(SCHEDULERS), required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--kill_after_save_at", type=int, default=-1)
  parser.add_argument("--kill_after_choices_at", type=int, default=-1)
  parser.add_argument("--storage", default="")
  parser.add_argument("--save_at", default="", help="the only steps checkpointed, e.g. 2")
  args = parser.parse_args()
  logging.getLogger().setLevel(logging.INFO)
  for noisy in ("absl", "jax", "orbax"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  config = conftest.cnn_config(**{
      "strategy.name": "pmap_ensemble", "sweep.metric": "nll", "sweep.mode": "min",
      "eval_every_steps": 2, "schedule.warmup_steps": 0, **SCHEDULERS[args.scheduler]})
  config.sweep.study.storage = args.storage
  trainer = FlaxStyleTrainer(config)
  checkpointer = KillingCheckpointer(os.path.join(args.workdir, "checkpoints"), every_steps=2,
                                     max_to_keep=3)
  checkpointer.kill_at = args.kill_after_save_at
  checkpointer.save_at = tuple(int(s) for s in args.save_at.split(",") if s)
  batches = conftest.image_batches(24, 16)
  try:
    result = trainer.fit(lambda start: batches[start:], num_steps=6, checkpointer=checkpointer,
                         workdir=args.workdir,
                         eval_batches=lambda: conftest.image_batches(2, 16, seed=9),
                         actions=[KillAfterChoices(args.kill_after_choices_at, checkpointer)])
  finally:
    checkpointer.close()
  np.savez(args.out, **flat(trainer.strategy.checkpoint_state(result.state)))
  print(f"finished at step {result.step}: {result.stopped_by}", flush=True)


if __name__ == "__main__":
  main()
