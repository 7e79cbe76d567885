"""A 2-process run that meets a fault schedule, one fault per attempt; run it through the
launcher with restarts:

    python -m trainer.distributed.launch --num_processes 2 --max_restarts 3 \
        tests/fault_run.py --root=R

It trains `spiky_mlp` (`tests/multiprocess_cases.py`) in `R/spiky_mlp`, whose batch stream
holds a loss spike, and injects by attempt (`TRAINER_RESTART`):

- attempt 0, at step 5: once checkpoint 4 is on disk, its array files are truncated (the
  corruption a restart finds) and process 1 is SIGKILLed;
- attempt 1: the write of checkpoint 8 fails with ENOSPC in orbax's background write
  (process 0's JSON item), which stops the run at the next save
  (`config.checkpoint.on_save_error="stop"`);
- attempt 2: no fault; it ends at step 12 and writes the final state to `out/`.
"""

import argparse
import errno
import glob
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import process_cache  # noqa: E402

from trainer.distributed import devices  # noqa: E402

process_cache.every_process_writes()

CASE, NUM_STEPS = "spiky_mlp", 12


def corrupt_and_kill(checkpoints: str):
  """At step 5 of attempt 0: truncate checkpoint 4's arrays, then SIGKILL process 1."""
  import jax
  from jax.experimental import multihost_utils

  def action(view):
    if view.step != 5:
      return
    if jax.process_index() == 0:
      marker = os.path.join(checkpoints, "4", "commit_success.txt")
      while not os.path.exists(marker):
        time.sleep(0.05)
      for f in glob.glob(os.path.join(checkpoints, "4", "state", "**", "d", "*"),
                         recursive=True):
        with open(f, "r+b") as fh:
          fh.truncate(7)
      print("fault: truncated the arrays of checkpoint 4", flush=True)
    multihost_utils.sync_global_devices("corrupted")
    if jax.process_index() == 1:
      os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # Process 0 waits to be stopped by the launcher.

  return action


def disk_full_at(step: int) -> None:
  """Makes orbax's write of checkpoint `step`'s JSON item fail with ENOSPC."""
  from etils import epath
  cls = type(epath.Path("/"))
  write_text = cls.write_text

  def write(self, *args, **kwargs):
    path = str(self)
    if f"/{step}.orbax-checkpoint-tmp/" in path and path.endswith("metadata"):
      print(f"fault: ENOSPC writing {path}", flush=True)
      raise OSError(errno.ENOSPC, "No space left on device", path)
    return write_text(self, *args, **kwargs)

  cls.write_text = write


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--root", required=True)
  args = parser.parse_args()
  devices.initialize(8)
  import multiprocess_cases as cases

  from trainer.loop.actions import PeriodicCallback

  attempt = int(os.environ.get("TRAINER_RESTART", "0"))
  workdir = os.path.join(args.root, CASE)
  actions = []
  if attempt == 0:
    actions = [PeriodicCallback(corrupt_and_kill(os.path.join(workdir, "checkpoints")),
                                every_steps=1)]
  elif attempt == 1:
    disk_full_at(8)
  with devices.naming_the_process():
    trainer, result = cases.run(CASE, workdir, NUM_STEPS, actions=actions)
    cases.save_result(trainer, result, os.path.join(workdir, "out"))
    print(f"{CASE}: step {result.step}, attempt {attempt}", flush=True)


if __name__ == "__main__":
  main()
