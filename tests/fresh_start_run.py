"""Fresh multi-process runs, started again and again; run it through the launcher:

    python -m trainer.distributed.launch --num_processes 2 tests/fresh_start_run.py \
        --root=R --rounds=2

Each round starts one fresh run of the `spiky_mlp` case (sharded data x tensor parallel,
watchdog on) in each way a run can be given its directories, under `R/<way>-<round>`:

- `workdir`: `fit(..., workdir=W)` with its checkpointer in `W/checkpoints`; W does not exist;
- `checkpointer`: `fit(..., checkpointer=Checkpointer(D))` and no workdir, so the run's lock
  is taken on D; D does not exist (process 0 makes it when it takes the lock);
- `existing`: the same into a directory that exists and is empty (the test makes it);
- `stale_view`: `checkpointer`, where process 0 does not yet see the directory it made (as a
  shared filesystem's cached view may lag); the other processes do.

Every process must enter the same barriers and collectives in each: a process that
skips one another enters waits there until gloo times out. Each run prints its last step.
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import process_cache  # noqa: E402

from trainer.distributed import devices  # noqa: E402

process_cache.every_process_writes()

WAYS = ("workdir", "checkpointer", "existing", "stale_view")
NUM_STEPS = 2


def fresh_run(way: str, directory: str):
  import jax
  import multiprocess_cases as cases

  from trainer.checkpoint import Checkpointer, store

  trainer = cases.trainer_of("spiky_mlp")
  trainer.config.checkpoint.every_steps = 1
  batches = cases.train_batches("spiky_mlp",
                                trainer.strategy.process_slice(trainer.config.batch_size))
  if way == "workdir":
    checkpointer, workdir = Checkpointer.from_config(trainer.config, directory), directory
  else:
    checkpointer, workdir = Checkpointer(directory, every_steps=1), None
  seen = store._on_disk
  if way == "stale_view" and jax.process_index() == 0:
    store._on_disk = lambda path: False
  try:
    return trainer.fit(batches, num_steps=NUM_STEPS, checkpointer=checkpointer, workdir=workdir)
  finally:
    store._on_disk = seen
    checkpointer.close()


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--root", required=True)
  parser.add_argument("--rounds", type=int, default=1)
  args = parser.parse_args()
  devices.initialize(8)  # 8 devices in all: 4 on each of 2 processes.
  with devices.naming_the_process():
    for r in range(args.rounds):
      for way in WAYS:
        result = fresh_run(way, os.path.join(args.root, f"{way}-{r}"))
        print(f"{way}-{r}: step {result.step}", flush=True)


if __name__ == "__main__":
  main()
