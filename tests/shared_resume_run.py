"""A LoRA sweep over one shared base (`shared_setup`) with checkpoints, for the SIGKILL
resume test of frozen parts held once.

    python tests/shared_resume_run.py --base=B --workdir=W --out=final.npz \
        [--kill_at=S | --kill_after_save_at=S]

Trains 8 steps of the 2-member sweep (the Llama at `B`, its base held once) on 8 host
devices, checkpointing every 4 steps and resuming from `W/checkpoints` when it holds one.
`--kill_at=S` SIGKILLs the process once step S is done (between checkpoints);
`--kill_after_save_at=S` once the checkpoint of step S is complete. Writes the final state
(checkpoint layout: the base once) to `--out`.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import conftest  # noqa: E402,F401 -- sets the 8 fake devices before jax starts.
from shared_setup import lora_config, stream  # noqa: E402
from sweep_run import fit_killed, killed_run_main  # noqa: E402

STEPS = 8


def run(args):
  from trainer.language_model import LanguageModelTrainer
  trainer = LanguageModelTrainer(lora_config(args.base, num_train_steps=STEPS))
  return trainer, fit_killed(trainer, stream, num_steps=STEPS, workdir=args.workdir,
                             kill_at=args.kill_at, kill_after_save_at=args.kill_after_save_at)


if __name__ == "__main__":
  killed_run_main(run, base="the Llama directory of preference_files.save_model")
