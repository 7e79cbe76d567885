r"""Train-step time on 2 processes x 4 devices against 1 process x 8 devices, in one run.

    python benchmarks/multiprocess_step_time.py [--steps 20] [--rounds 2] [--batch 128]

For each workload the same config runs twice per round: in one process with 8
CPU devices, and through `python -m trainer.distributed.launch --num_processes 2` (gloo
collectives between the processes, 4 devices each). Each process feeds its
own rows of every batch (the strategy's `process_slice`), as a multi-host run does.
Steps are timed after compilation and warm-up, through `Trainer.fit` with a
bare loop of actions (no logging, eval or checkpoints), so the figure
includes placing the batches; the median over rounds is shown with the ratio
2x4 / 1x8 (machines are shared and noisy: compare ratios).

Workloads: `cnn_dp` (MNIST CNN, jit data parallel over 8 devices),
`cnn_ensemble` (8 CNN members spread over both processes, every process
feeding the whole batch), `lm_fsdp` (the transformer LM with every weight
sharded over the 8 devices).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

WORKLOADS = ("cnn_dp", "cnn_ensemble", "lm_fsdp")


def _config(workload: str, batch: int):
  from configs import lm, mnist_ensemble
  if workload == "lm_fsdp":
    config = lm.get_config("fsdp")
    config.batch_size = batch
  else:
    config = mnist_ensemble.get_config()
    config.batch_size = batch
    config.strategy.name = "sharded_ensemble" if workload == "cnn_ensemble" else \
        "sharded_data_parallel"
    config.ensemble_size = 8
  config.log_every_steps = 0
  config.eval_every_steps = 0
  return config


def worker(args) -> None:
  """Times one workload in this process (one of several when launched)."""
  from trainer.distributed import devices
  devices.initialize(8)
  import jax
  from mnist_setup import MNISTTrainer, random_batches

  from trainer import LanguageModelTrainer
  from trainer.language_model import synthetic_token_batches
  from trainer.loop.actions import Action

  config = _config(args.workload, args.batch)
  if args.workload == "lm_fsdp":
    trainer = LanguageModelTrainer(config)
    rows = trainer.strategy.process_slice(config.batch_size)
    stream = lambda start: synthetic_token_batches(  # noqa: E731
        0, config.batch_size, config.seq_len, config.model.vocab_size, start, rows)
  else:
    trainer = MNISTTrainer(config)
    rows = trainer.strategy.process_slice(config.batch_size)
    local = [{k: v[rows] for k, v in b.items()} for b in random_batches(config.batch_size)]
    stream = lambda start: (local[i % len(local)] for i in range(start, 10**9))  # noqa: E731

  class Clock(Action):
    """Notes the time at the end of warm-up and at the last step."""

    def __init__(self):
      super().__init__(every_steps=1)
      self.times = {}

    def run(self, view):
      if view.step in (args.warmup, args.warmup + args.steps):
        jax.block_until_ready(view.state)
        self.times[view.step] = time.perf_counter()

  clock = Clock()
  trainer.default_actions = lambda **_: []  # A bare loop: no logging, eval or checkpoints.
  trainer.fit(stream, num_steps=args.warmup + args.steps, actions=[clock])
  seconds = (clock.times[args.warmup + args.steps] - clock.times[args.warmup]) / args.steps
  if jax.process_index() == 0:
    print("RESULT " + json.dumps({"seconds": seconds, "processes": jax.process_count(),
                                  "devices": jax.device_count(),
                                  "backend": jax.default_backend(),
                                  "version": jax.__version__}), flush=True)


def _run(argv: list[str], processes: int) -> dict:
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  command = [sys.executable, *argv] if processes == 1 else [
      sys.executable, "-m", "trainer.distributed.launch", "--num_processes", str(processes), *argv]
  result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
  for line in result.stdout.splitlines():
    if "RESULT " in line:
      return json.loads(line.split("RESULT ", 1)[1])
  raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}"
                     f"\n{result.stderr[-3000:]}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--workloads", default=",".join(WORKLOADS))
  parser.add_argument("--workload", help=argparse.SUPPRESS)  # Set in the timed processes.
  args = parser.parse_args()
  if args.workload:
    worker(args)
    return

  times: dict[tuple[str, int], list[float]] = {}
  info = None
  for _ in range(args.rounds):
    for workload in args.workloads.split(","):
      for processes in (1, 2):  # Alternated, so drifts in machine load hit both.
        argv = ["benchmarks/multiprocess_step_time.py", f"--workload={workload}",
                f"--steps={args.steps}", f"--warmup={args.warmup}", f"--batch={args.batch}"]
        info = _run(argv, processes)
        times.setdefault((workload, processes), []).append(info["seconds"])
  print(f"jax {info['version']}, backend {info['backend']}, 8 devices in all, batch "
        f"{args.batch}, {args.steps} timed steps, median of {args.rounds} round(s)")
  print(f"{'workload':14s} {'1x8 s/step':>11s} {'2x4 s/step':>11s} {'2x4 / 1x8':>10s}")
  for workload in args.workloads.split(","):
    one = statistics.median(times[(workload, 1)])
    two = statistics.median(times[(workload, 2)])
    print(f"{workload:14s} {one:11.4f} {two:11.4f} {two / one:9.3f}x")


if __name__ == "__main__":
  main()
