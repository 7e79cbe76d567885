"""A distillation run (`distill_setup`, tiny) with checkpoints, for the SIGKILL resume test.

    python tests/distill_resume_run.py --models=M --workdir=W --out=final.npz \
        [--kill_at=S | --kill_after_save_at=S]

Trains 8 steps under FSDP on 8 host devices at `lmbda=0.5` (some batches the student's
samples, some the records'), checkpointing every 4 steps and resuming from `W/checkpoints`
when it holds one. `--kill_at=S` SIGKILLs the process once step S is done (between
checkpoints); `--kill_after_save_at=S` once the checkpoint of step S is complete. Writes
the final state (checkpoint layout, the teacher included) to `--out`.
"""

import os
import pathlib
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import conftest  # noqa: E402,F401 -- sets the 8 fake devices before jax starts.
import distill_setup  # noqa: E402
from sweep_run import fit_killed, killed_run_main  # noqa: E402

STEPS = 8


def run(args):
  from trainer.distill import DistillationTrainer
  from trainer.distill import data as distill_data
  config = distill_setup.config(pathlib.Path(args.models), "llama", "fsdp",
                                num_train_steps=STEPS, **{"distill.lmbda": 0.5})
  trainer = DistillationTrainer(config)
  return trainer, fit_killed(trainer, distill_data.from_config(config), num_steps=STEPS,
                             workdir=args.workdir, kill_at=args.kill_at,
                             kill_after_save_at=args.kill_after_save_at)


if __name__ == "__main__":
  killed_run_main(run, models="the directory of distill_setup.save_models")
