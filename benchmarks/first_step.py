r"""Time to the first step: how long a run takes from `python ...` to its first logged step.

    python benchmarks/first_step.py [--programs imports,lm,mnist,finetune] [--baseline REF]

Each program runs in a fresh interpreter with an empty JAX compilation cache (so the first
compile is counted, as a user's first run pays it), one train step, metrics logged every
step; the figure is the wall time until the console line of step 1 (`step 1/N: ...`),
which holds the imports, the model build, the state's init (and a checkpoint's restore),
and the first compile:

- `imports`: `import trainer` and a metric writer made (no step: until the process exits);
- `lm`: `examples/transformer_lm.py` (configs/lm.py, data parallel over 8 CPU devices);
- `mnist`: `examples/mnist_ensemble.py` on 512 real MNIST images (`--mnist_dir`);
- `finetune`: `examples/finetune_lm.py` (a 2-layer GPT-2 written in HF format, loaded,
  FSDP over 8 devices; the base model is written before the clock's first step counts).

Each program runs once untimed first (MNIST's TFDS files are prepared then, and the
OS's file cache is warm for both columns alike). `--baseline REF` runs the same commands
in a git worktree of REF (e.g. the commit before a change) in the same run, one after the
other per program, and prints both and their ratio: the machines here are shared and
noisy, so only a ratio measured side by side is worth quoting.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Step 1's console line: the loop's `step 1/N: ...` (a baseline's `[1] train/...`).
FIRST_STEP = re.compile(r"\[1\] (train|eval)/|step 1/")


def commands(root: pathlib.Path, workdir: str, mnist_dir: str) -> dict[str, list[str]]:
  py = sys.executable
  common = ["--config.num_train_steps=1", "--config.log_every_steps=1"]
  return {
      "imports": [py, "-c", "import tempfile\nfrom trainer import writers, Trainer\n"
                  "writers.create_writer(tempfile.mkdtemp()).close()"],
      "lm": [py, str(root / "examples/transformer_lm.py"), "--config=configs/lm.py",
             f"--workdir={workdir}/lm", *common, "--config.eval_every_steps=0",
             "--config.schedule.warmup_steps=0"],
      "mnist": [py, str(root / "examples/mnist_ensemble.py"),
                "--config=configs/mnist_ensemble.py", f"--workdir={workdir}/mnist",
                f"--config.data.manual_dir={mnist_dir}", *common,
                "--config.data.train_split=train[:512]", "--config.data.eval_split=test[:600]"],
      "finetune": [py, str(root / "examples/finetune_lm.py"), f"--workdir={workdir}/finetune",
                   *common, "--config.schedule.warmup_steps=0", "--samples=1",
                   "--sample_tokens=2"],
  }


def time_to_first_step(command: list[str], cwd: pathlib.Path, cache: str) -> float:
  """Seconds from the start until the step-1 console line (or the exit, if none is logged).

  Raises:
    RuntimeError: the program failed.
  """
  env = dict(os.environ, PYTHONPATH=str(cwd), JAX_COMPILATION_CACHE_DIR=cache,
             PYTHONUNBUFFERED="1")
  start = time.perf_counter()
  process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
  seen, lines = None, []
  for line in process.stdout:
    lines.append(line)
    if seen is None and FIRST_STEP.search(line):
      seen = time.perf_counter() - start
  if process.wait():
    raise RuntimeError(f"{' '.join(command)} failed:\n{''.join(lines[-20:])}")
  return seen if seen is not None else time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--programs", default="imports,lm,mnist,finetune")
  parser.add_argument("--baseline", default="", help="A git ref to run side by side.")
  parser.add_argument("--mnist_dir", default=str(ROOT.parent / "shared" / "data" / "mnist"))
  args = parser.parse_args()
  programs = args.programs.split(",")
  trees = {"now": ROOT}
  scratch = tempfile.mkdtemp(prefix="first_step_")
  if args.baseline:
    base = pathlib.Path(scratch) / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base),
                    args.baseline], check=True, capture_output=True)
    trees = {args.baseline: base, "now": ROOT}
  try:
    print(f"time to the first step (s), fresh interpreter and compilation cache, "
          f"{os.cpu_count()} CPUs")
    print(f"{'program':10s}" + "".join(f"{name:>14s}" for name in trees) +
          ("   now/baseline" if len(trees) > 1 else ""))
    for program in programs:
      # Untimed, once: prepares what every run after it finds ready in both trees alike
      # (MNIST's TFDS files, the OS's file cache), so neither column pays it.
      time_to_first_step(commands(ROOT, tempfile.mkdtemp(dir=scratch), args.mnist_dir)[program],
                         ROOT, tempfile.mkdtemp(dir=scratch))
      row = []
      for tree in trees.values():
        workdir = tempfile.mkdtemp(dir=scratch)
        cache = tempfile.mkdtemp(dir=scratch)
        command = commands(tree, workdir, args.mnist_dir)[program]
        row.append(time_to_first_step(command, tree, cache))
      ratio = f"{row[-1] / row[0]:15.2f}" if len(row) > 1 else ""
      print(f"{program:10s}" + "".join(f"{t:14.1f}" for t in row) + ratio, flush=True)
  finally:
    if args.baseline:
      subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                      str(trees[args.baseline])], check=False, capture_output=True)


if __name__ == "__main__":
  main()
