"""The multi-process side of `tests/test_multiprocess.py`; run it through the launcher:

    python -m trainer.distributed.launch --num_processes 2 tests/multiprocess_run.py \
        --root=R --cases=resnet_dp,lm_fsdp [--num_steps=4] [--step_seconds=0.2]

For each case it trains in `R/<case>` (`case@dir`: in `R/<dir>`), resuming
from the checkpoints there when there are some, and writes the final state and
eval to `out/` in that directory. `--step_seconds` slows every step down, so that a test can
signal a process while it trains.
"""

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import process_cache  # noqa: E402

from trainer.distributed import devices  # noqa: E402

process_cache.every_process_writes()


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--root", required=True)
  parser.add_argument("--cases", required=True)
  parser.add_argument("--num_steps", type=int, default=0)
  parser.add_argument("--step_seconds", type=float, default=0.0)
  args = parser.parse_args()
  devices.initialize(8)  # 8 devices in all: 4 on each of 2 processes.

  import multiprocess_cases as cases

  from trainer.loop.actions import PeriodicCallback

  with devices.naming_the_process():
    for entry in args.cases.split(","):
      case, _, dirname = entry.partition("@")
      extra = []
      if args.step_seconds:
        extra = [PeriodicCallback(lambda loop: time.sleep(args.step_seconds), every_steps=1)]
      workdir = os.path.join(args.root, dirname or case)
      trainer, result = cases.run(case, workdir, args.num_steps or cases.NUM_STEPS,
                                  actions=extra)
      cases.save_result(trainer, result, os.path.join(workdir, "out"))
      print(f"{case}: step {result.step}, stopped by {result.stopped_by}", flush=True)


if __name__ == "__main__":
  main()
