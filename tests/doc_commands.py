"""The shell commands of the README and the docs, and how the tests run each with few steps.

A command is a line of a ```bash block (lines ending in `\\` continue), in
`README.md` or a page under `docs/`; a command that appears in several places
is run once. `Runner` runs one as a user would from the repository root: the
README's `.venv/bin/...` programs are this interpreter's, paths under `/tmp/`
move into a test directory, and flags that cut the run short (few steps, a
slice of MNIST) are appended, so the rest of the command line is exactly the
documented one. What a command runs is what comes after its install steps
(`python3 -m venv`, `pip install`), which CI's own install stands in for.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: Every page whose commands the tests run: the README, then the docs' pages in order.
PAGES = (README, *sorted((ROOT / "docs").rglob("*.md")))
MNIST_DIR = ROOT.parent / "shared" / "data" / "mnist"
BIN = pathlib.Path(sys.executable).parent


def _gpu_smoke_args(stage: str) -> list[str]:
  """The arguments of `benchmarks/gpu.py`'s smoke size of `stage`, less the script name."""
  spec = importlib.util.spec_from_file_location("gpu_stages", ROOT / "benchmarks" / "gpu.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)  # Imports the standard library only; runs nothing.
  return list(module.STAGES[stage]["smoke"][1:])


#: Flags appended to a script's documented command so that it runs in seconds.
FEW_STEPS = {
    "examples/my_trainer.py": [],  # 100 steps of a tiny MLP: seconds as written.
    "examples/write_corpus.py": [],  # Writes a corpus of the docs' paragraphs: seconds.
    # One eval batch of the configs' 500 (padding a short last batch: tests/test_loop.py).
    "examples/mnist_ensemble.py": [
        "--config.num_train_steps=2", "--config.log_every_steps=1",
        "--config.data.train_split=train[:512]", "--config.data.eval_split=test[:500]"],
    "examples/transformer_lm.py": [
        "--config.num_train_steps=2", "--config.log_every_steps=1",
        "--config.eval_every_steps=0", "--config.schedule.warmup_steps=0"],
    # The row the output check reads, beside its single_device baseline.
    "benchmarks/strategy_step_time.py": ["--steps", "1", "--batch", "16", "--strategies",
                                         "pmap_ensemble"],
    # The 4-members-on-one-device comparison: the 8-device one compiles 8-member programs.
    "benchmarks/ensemble_step_time.py": ["--steps", "1", "--repeats", "1", "--batch", "16",
                                         "--groups", "4on1"],
    "benchmarks/loop_overhead.py": ["--pairs", "1", "--block-seconds", "0", "--batch", "16",
                                    "--strategies", "single_device,sharded_ensemble"],
    "benchmarks/batch_axis_overhead.py": ["--pairs", "2", "--block-seconds", "0", "--batch",
                                          "16", "--strategies", "pmap_ensemble"],
    # Two devices: under 8 a 25M-parameter LM (`--lm-size gpu`) does 8 optimizer updates.
    "benchmarks/recipe_cost.py": ["--rounds", "1", "--block-seconds", "0", "--batch", "16",
                                  "--workloads", "lm", "--variants", "bf16", "--devices", "2",
                                  "--lm-batch", "16", "--lm-seq", "16", "--lm-layers", "1"],
    "benchmarks/multiprocess_step_time.py": ["--steps", "1", "--warmup", "1", "--rounds", "1",
                                             "--batch", "16", "--workloads", "cnn_dp"],
    "benchmarks/structure.py": [],  # Reads source files only: seconds as written.
    # One Linen layer of width 64 (one head of 64: blocks of 64 divide every input axis).
    "benchmarks/qlora.py": ["--families", "gpt2", "--bases", "nf4", "--layers", "1", "--width",
                            "64", "--seq", "32", "--batch", "2", "--rounds", "1",
                            "--block-seconds", "0"],
    "trainer.generate": [],  # A few tokens from the fine-tune's checkpoint: seconds.
    "trainer.harness": [],  # 28 requests of the example tasks: seconds.
    "benchmarks/harness_cost.py": ["--steps", "2", "--repeats", "1"],
    "benchmarks/generation.py": ["--new", "4", "--batch", "2", "--prompt", "8", "--layers", "1",
                                 "--embed", "64", "--vocab", "64", "--repeats", "1"],
    # k=2 alone: fit with host and with device data, and the hand-written scan, at k > 1
    # (k=1 is every other test's step).
    "benchmarks/steps_per_call.py": ["--ks", "2", "--models", "one", "--steps", "2",
                                     "--repeats", "1", "--batch", "16"],
    # Halving alone, trials of 2 steps on 512 images (the data the first command prepared),
    # evaluated on one eval batch.
    "benchmarks/sweep_schedulers.py": ["--runs", "halving", "--selection-repeats", "1",
                                       "--config.num_train_steps=2",
                                       "--config.data.train_split=train[:512]",
                                       "--config.data.eval_split=test[:500]"],
    # The sizes of benchmarks/gpu.py's smoke sweep stage, read from it: the two share programs.
    "benchmarks/sweep_vs_runs.py": _gpu_smoke_args("sweep"),
    "benchmarks/lm_mfu.py": ["--steps", "1", "--repeats", "1", "--layers", "1", "--batch", "2",
                             "--matmul", "256"],
    "trainer.plan": [],  # Compiles one step abstractly: seconds as written.
    "benchmarks/remat.py": ["--rounds", "1", "--block-seconds", "0", "--layers", "2", "--seq",
                            "32", "--batch", "4", "--variants", "blocks/nothing"],
    "benchmarks/pipeline.py": ["--steps", "1", "--batch", "16", "--embed", "32", "--seq", "16",
                               "--layers", "4", "--rows", "dp,gpipe_m4"],
    "examples/finetune_lm.py": ["--config.num_train_steps=2", "--config.log_every_steps=1",
                                "--config.schedule.warmup_steps=0", "--samples=1",
                                "--sample_tokens=2"],
    "examples/preference_lm.py": ["--config.num_train_steps=2", "--config.log_every_steps=1",
                                  "--config.schedule.warmup_steps=0"],
    "examples/rl_lm.py": ["--config.num_train_steps=2", "--config.log_every_steps=1"],
    # A teacher of 2 steps (tests/test_distill.py runs the whole example).
    "examples/distill_lm.py": ["--config.num_train_steps=2", "--config.log_every_steps=1",
                               "--config.schedule.warmup_steps=0", "--config.teacher.steps=2"],
    "benchmarks/distill.py": ["--steps", "2", "--timing-steps", "1", "--teacher-steps", "2"],
    "benchmarks/shared_lora.py": _gpu_smoke_args("shared_lora"),
    "benchmarks/preference.py": ["--layers", "1", "--embed", "64", "--vocab", "64", "--seq",
                                 "32", "--pairs", "4", "--steps", "2", "--repeats", "1",
                                 "--devices", "2", "--rows", "sft,dpo copy"],
    "benchmarks/rl.py": _gpu_smoke_args("rl"),  # benchmarks/gpu.py's smoke rl stage.
    "benchmarks/rl_tools.py": _gpu_smoke_args("rl_tools"),
    "trainer.export": [],  # Reads one checkpoint: seconds as written.
    "trainer.data.train_tokenizer": [],  # A 1024-token BPE on the docs' paragraphs: seconds.
    "benchmarks/hf_load.py": ["--layers", "1", "--embed", "64", "--vocab", "256"],
    # The import row alone: two interpreters per column (an untimed one first).
    "benchmarks/first_step.py": ["--programs", "imports"],
    "benchmarks/long_context.py": ["--seqs", "64", "--contexts", "2", "--methods", "ring",
                                   "--rounds", "1", "--block-seconds", "0"],
    # Optuna's loop and the study in one program: one trial of 2 steps, in one slot.
    "benchmarks/study.py": ["--trials", "1", "--slots", "1", "--steps", "2", "--eval-every", "2",
                            "--steps-per-call", "2", "--runs", "optimize,program",
                            "--keep-cache", "--config.data.train_split=train[:512]",
                            "--config.data.eval_split=test[:200]"],
    # The einsum row the output check reads, beside its dense baseline.
    "benchmarks/moe.py": ["--experts", "8", "--seq", "16", "--batch", "2", "--embed", "32",
                          "--expert-width", "32", "--rounds", "1", "--block-seconds", "0",
                          "--runs", "einsum capacity 1.25"],
    # Without a GPU the script runs its smoke sizes; two stages (each stage's script
    # runs on its own above).
    "benchmarks/gpu.py": ["--only", "attention,sweep"],
    "benchmarks/corpus.py": ["--sizes-mb", "1,2", "--batches", "5", "--late", "20",
                             "--workers", "1"],
}

#: Flags appended after the script's few-step ones to a command that runs one of these
#: configs: a study of 8 trials (one round of its 8 slots) instead of 32; the tool task's
#: warm start of 2 steps (tests/test_rl_tools.py runs the whole example).
FEW_STEPS_FOR_CONFIG = {"configs/mnist_study.py": ["--config.sweep.study.n_trials=8"],
                        "configs/rl.py:tools": ["--config.warm_start.steps=2"]}

#: Documented paths that another documented command makes: before a command that reads one
#: runs, the command that makes it runs (with its few-step flags) unless it already has.
MADE_BY = {
    "/tmp/finetune": ".venv/bin/python examples/finetune_lm.py --workdir=/tmp/finetune",
    "/tmp/finetune_lora": (".venv/bin/python examples/finetune_lm.py "
                           "--config=configs/finetune_lm.py:lora --workdir=/tmp/finetune_lora "
                           "--config.init_from.path=/tmp/finetune/hf --text=trainer/**/*.py"),
    "/tmp/corpus": ".venv/bin/python examples/write_corpus.py --out=/tmp/corpus",
    "/tmp/my_tokenizer": (".venv/bin/python -m trainer.data.train_tokenizer "
                          "--files='/tmp/corpus/train-*.jsonl.gz' --vocab_size=1024 "
                          "--out=/tmp/my_tokenizer"),
    "/tmp/mnist_study": (".venv/bin/python examples/mnist_ensemble.py "
                         "--config=configs/mnist_study.py --workdir=/tmp/mnist_study "
                         "--config.data.manual_dir=../shared/data/mnist"),
}

#: What a script's standard output shows when it did its job. Timings and ratios take any
#: number of integer digits: a loaded machine makes a step 10x slower, not a failure.
EXPECTED_OUTPUT = {
    "examples/my_trainer.py": r"^\w+: loss=\d+\.\d{4}$",
    "examples/write_corpus.py": r"^wrote \d+ train documents in 4 shards, \d+ held out",
    "examples/mnist_ensemble.py": r"(^|\s)(ensemble_)?accuracy=\d\.\d{4}",
    "examples/transformer_lm.py": r"(^|\s)loss=\d+\.\d{4}",
    "benchmarks/strategy_step_time.py": r"pmap_ensemble\s+8\s+\d",
    "benchmarks/ensemble_step_time.py": r"sharded_ensemble 4 on 1 \(map\)\s+\d",
    "benchmarks/loop_overhead.py": r"sharded_ensemble\s+\d+\.\d{4}\s+\d+\.\d{4}\s+\d+\.\d{3}x",
    "benchmarks/batch_axis_overhead.py": r"pmap_ensemble\s+\d+\.\d{4}\s+\d+\.\d{4}\s+\d+\.\d{3}x",
    "benchmarks/recipe_cost.py": r"Transformer LM .* bf16\s+\d+\.\d{4}\s+\d+\.\d{3}x",
    "benchmarks/multiprocess_step_time.py": r"cnn_dp\s+\d+\.\d{4}\s+\d+\.\d{4}\s+\d+\.\d{3}x",
    "benchmarks/structure.py": r"^import cycles\s+\S+\s+0$",
    "benchmarks/qlora.py": r"^gpt2\s+nf4\s+\d+\.\d{2}\s+\d\.\d{3}x\s+\d+\.\d{2}\s+0\.\d{3}x",
    "benchmarks/steps_per_call.py": r"one\s+2\s+\d+\.\d\s+\d+\.\d\s+\d+\.\d\s+\d+\.\d{3}x",
    "benchmarks/sweep_schedulers.py": r"^selection step .* ratio \d+\.\d{2}$",
    "benchmarks/sweep_vs_runs.py": r"^ratio\s+\d+\.\d{2}x\s+\d+\.\d{2}x",
    "benchmarks/lm_mfu.py": (r"^cpu\s+float32\s+\d+\.\dM\s+\d+\.\d\s+\d+\.\d{4}\s+\d+\s+"
                             r"\d+\.\d{3}\s+\S+\s+\d+\.\d%"),
    "trainer.plan": r"^  (fits|does NOT fit): peak [\d,.]+ MiB of",
    "benchmarks/remat.py": r"^blocks/nothing\s+\d+\.\d\s+\d+\.\d{2}x\s+\d+\.\d{4}\s+\d+\.\d{3}x",
    "benchmarks/pipeline.py": r"^gpipe_m4\s+\d+\.\d{4}\s+\d+\.\d{2}x\s+42\.9%\s+\d",
    "examples/finetune_lm.py": r"^validation loss: before=\d+\.\d{4} after=\d+\.\d{4}",
    "trainer.export": r"^wrote \d+ tensors to \S+model\.safetensors",
    "examples/preference_lm.py": (r"^held-out pairs \(\w+\): reward accuracy \d\.\d{3} -> "
                                  r"\d\.\d{3}, margin -?\d+\.\d{4} -> -?\d+\.\d{4}"),
    "examples/rl_lm.py": r"^held-out mean reward: before=\d\.\d{3} after=\d\.\d{3}",
    "examples/distill_lm.py": r"^held-out reverse_kl: before=\d+\.\d{4} after=\d+\.\d{4}$",
    "benchmarks/distill.py": r"^sft step\s+\d+\.\d{4}\s+\d+\.\d{2}x$",
    "benchmarks/shared_lora.py": r"^2 separate runs\s+\d+\.\d{5}\s+\(\d+\.\d{2}x shared's",
    "benchmarks/preference.py": r"^dpo copy\s+\d+\.\d{4}\s+\d+\.\d{2}x\s+\d+\.\d{2}$",
    "benchmarks/rl.py": r"^two-state loop\s+\d+\.\d{4}\s+\d+\s+\d+\.\d{2}x$",
    "benchmarks/rl_tools.py": r"^prefix again\s+\d+\.\d{4}\s+\d+\s+\d+\.\d{2}x$",
    "trainer.data.train_tokenizer": r"^wrote a 1024-token byte-level BPE tokenizer trained on \d+ ",
    "trainer.generate": r"^\[0\] '(<\|bos\|>)?The tests make'\n  -> ['\"].*['\"]$",
    "trainer.harness": r"^docs_choice/acc: \d\.\d{4}$",
    "benchmarks/harness_cost.py": r"^harness action\s+\d+\.\d{4}\s+\d+\.\dx$",
    "benchmarks/generation.py": (r"^\s+4 cached\s+\d+\.\d{4}\s+\d+\.\d\s+\d+\.\d{2}x\s+"
                                 r"\d+\.\d{2}\s+\d+\.\d{2}\s+\d+\.\d%$"),
    "benchmarks/hf_load.py": r"^fsdp \(8 devices\)\s+\d+\.\d\s+\d+\.\d{3}\s+\d+\.\d{2}",
    "benchmarks/first_step.py": r"^imports\s+\d+\.\d\s+\d+\.\d\s+\d+\.\d{2}$",
    "benchmarks/long_context.py": r"^\s+64 context=2 ring\s+\d+\.\d\s+\d+\.\d{3}x\s+\d+\.\d{2}",
    "benchmarks/study.py": r"^program / optimize: wall \d+\.\d{2}x, model-steps \d+\.\d{2}x",
    "benchmarks/moe.py": (r"^\s+8 einsum capacity 1\.25\s+\d+\.\d\s+\d+\.\d{2}x\s+\d+\.\d{4}\s+"
                          r"\d+\.\d{2}x"),
    "benchmarks/gpu.py": r"^2 of 2 stages ok; results in \S+gpu_results\.md$",
    "benchmarks/corpus.py": r"^  step\s+20\s+read\s+\d+\.\d{2} s\s+resume\s+\d+\.\d{4} s",
}


def page_commands(page: pathlib.Path) -> list[str]:
  """Every command line of a page's bash blocks, in order."""
  lines = []
  for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
      if line.strip() and not line.lstrip().startswith("#"):
        lines.append(" ".join(line.split()))
  return lines


def commands(pages=PAGES) -> list[str]:
  """Every command of the README and the docs, each once, in the order they appear."""
  return list(dict.fromkeys(c for page in pages for c in page_commands(page)))


#: The corpus guide's path from text files to a Hugging Face model: its first block of
#: commands, which `tests/test_user_path.py` runs in order (and no other test runs again).
USER_PATH_PAGE = ROOT / "docs" / "guides" / "corpus.md"


def user_path() -> list[str]:
  """The commands of the corpus guide's first bash block, in order."""
  block = re.search(r"```bash\n(.*?)```", USER_PATH_PAGE.read_text(), flags=re.S).group(1)
  return [" ".join(line.split()) for line in block.splitlines() if line.strip()]


def on_the_user_path(command: str) -> bool:
  return command in user_path()


# The run the path's later commands read: the corpus guide's own training command.
MADE_BY["/tmp/lm_corpus"] = next(c for c in user_path() if "--workdir=/tmp/lm_corpus" in c)


def is_test_command(command: str) -> bool:
  """The README's test command: CI runs it (`.ci/run`), so no test runs it again."""
  return "-m pytest" in command


def is_docs_command(command: str) -> bool:
  """The command that builds (and serves) the docs: `tests/test_docs.py` runs it."""
  return "sphinx-build" in command


def script_of(command: str) -> str | None:
  """The repository script a `python` command runs (a module run with `-m trainer....`:
  its name), if any."""
  match = re.search(r"\s((?:examples|benchmarks)/\S+\.py|(?<=-m )trainer\.(?!distributed)\S+)",
                    " " + last_step(command))
  return match.group(1) if match else None


def steps(command: str) -> list[str]:
  """What a command runs once it has installed: its `&&` steps after the install ones."""
  parts = [p.strip() for p in command.split("&&")]
  return [p for p in parts if not (p.startswith("python3 -m venv") or " install " in f" {p} ")]


def last_step(command: str) -> str:
  """The command's last step (what it is for: an example, a benchmark, a server)."""
  return steps(command)[-1]


#: What a user's shell holds that a documented command may rely on. Nothing else of the
#: tests' environment reaches one: a variable the tests (or this machine) set would hide a
#: step the documented command must take itself, as a data directory named by the test
#: once hid that the docs command did not name MNIST's files.
SHELL_VARIABLES = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "USER", "LOGNAME", "SHELL",
                   "TMPDIR")
#: The tests' own variables that still reach a command: JAX's persistent compilation cache
#: (`tests/conftest.py`), which changes how long a program compiles, never what it computes.
CACHE_VARIABLES = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")


def assignments(step: str) -> tuple[dict[str, str], str]:
  """A step's leading `NAME=value` words (what the shell puts in the command's
  environment), and the rest of the step."""
  words, env = shlex.split(step), {}
  while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
    name, value = words.pop(0).split("=", 1)
    env[name] = value
  return env, shlex.join(words)


@dataclasses.dataclass
class Runner:
  """Runs documented commands from the repository root with their `/tmp/` paths under `root`,
  as a user's fresh shell would: `SHELL_VARIABLES` and a home of its own (`root/home`, so
  TFDS's data directory `~/tensorflow_datasets` starts empty), plus what the command sets."""

  root: pathlib.Path

  @property
  def home(self) -> pathlib.Path:
    return self.root / "home"

  @property
  def data_dir(self) -> pathlib.Path:
    """TFDS's default data directory in this runner's home: where the first command
    prepares MNIST, and the later ones read it."""
    return self.home / "tensorflow_datasets"

  def path(self, documented: str) -> pathlib.Path:
    """Where a documented `/tmp/...` path lives in this test run."""
    return self.root / documented.removeprefix("/tmp/")

  def argv(self, command: str, extra: list[str] | None = None, step: str | None = None
           ) -> list[str]:
    """The argv of `step` (default: the command's last), paths moved, `extra` appended
    (its leading `NAME=value` words are the environment's: `env`)."""
    program, *args = shlex.split(assignments(step or last_step(command))[1])
    # Only the command's own arguments move: this interpreter may itself live under /tmp/.
    args = [re.sub(r"(^|[=(\"'])/tmp/", lambda m: m.group(1) + str(self.root) + "/", a)
            for a in args]
    if program.startswith(".venv/bin/"):
      name = program.removeprefix(".venv/bin/")
      program = sys.executable if name == "python" else str(BIN / name)
    script = script_of(command)
    if extra is None:
      extra = FEW_STEPS.get(script, []) + [
          flag for config, flags in FEW_STEPS_FOR_CONFIG.items()
          if f"--config={config}" in args for flag in flags]
    return [program, *args, *extra]

  def env(self, step: str = "") -> dict[str, str]:
    """A fresh shell's environment (`SHELL_VARIABLES`, this runner's home, the compilation
    cache), with what `step` itself sets."""
    self.home.mkdir(parents=True, exist_ok=True)
    env = {name: os.environ[name] for name in SHELL_VARIABLES + CACHE_VARIABLES
           if name in os.environ}
    env["HOME"] = str(self.home)
    env.update(assignments(step)[0])
    return env

  def run(self, command: str, extra: list[str] | None = None, timeout: float = 900,
          step: str | None = None) -> subprocess.CompletedProcess:
    """Runs `step` of `command` (default: its last) with `extra` flags, or the few-step
    ones."""
    step = step or last_step(command)
    return subprocess.run(self.argv(command, extra, step), cwd=ROOT, env=self.env(step),
                          capture_output=True, text=True, timeout=timeout)

  def popen(self, command: str, extra: list[str], step: str | None = None) -> subprocess.Popen:
    step = step or last_step(command)
    return subprocess.Popen(self.argv(command, extra, step), cwd=ROOT, env=self.env(step),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# -- Running them in tests (tests/test_doc_commands.py, tests/test_doc_commands_mnist.py) ------


def reads_real_mnist(command: str) -> bool:
  """MNIST commands read the data the first command prepared; TensorBoard reads its logs."""
  return (script_of(command) in ("examples/mnist_ensemble.py", "benchmarks/sweep_schedulers.py",
                                 "benchmarks/study.py")
          or last_step(command).startswith((".venv/bin/tensorboard", ".venv/bin/optuna-dashboard")))


def runnable() -> list[str]:
  """Every command `run_and_check` runs: all but the test command (CI runs that) and the
  docs command (`tests/test_docs.py` builds, serves and opens the docs with it)."""
  return [c for c in commands() if not is_test_command(c) and not is_docs_command(c)]


def command_id(command: str) -> str:
  return last_step(command).removeprefix(".venv/bin/")[:90]


def make_what_it_reads(command: str, runner: Runner) -> None:
  """Runs the makers of the documented paths `command` reads that do not exist yet (and
  theirs first: a LoRA run on the fine-tuned model)."""
  for path, maker in MADE_BY.items():
    reads = re.search(rf"[=\s'\"(]({re.escape(path)})(/|\s|$)", command)
    if reads and maker != command and not runner.path(path).exists():
      make_what_it_reads(maker, runner)
      check(maker, runner.run(maker))


def run_and_check(command: str, runner: Runner) -> None:
  """Runs a documented command with few steps (or serves TensorBoard) and checks its output."""
  make_what_it_reads(command, runner)
  if script_of(command):
    script = script_of(command)
    assert script in FEW_STEPS, f"no few-step flags for {script} in doc_commands.py"
    result = runner.run(command)
  elif last_step(command).startswith(".venv/bin/tensorboard"):
    _serves_the_logged_scalars(command, runner)
    return
  elif last_step(command).startswith(".venv/bin/optuna-dashboard"):
    _serves_the_study(command, runner)
    return
  else:
    pytest.fail(f"documented command {command!r} has no runner in tests/doc_commands.py")
  check(command, result)


#: What reads like a failure when nothing failed: the stack's start-up notices
#: (`trainer.console`), none of which a documented command may print.
NOT_FAILURES = (r"Unable to initialize backend 'tpu'", r"oneDNN custom operations",
                r"OpenCV is not installed", r"rebuild TensorFlow with the appropriate compiler")


def check(command: str, result: subprocess.CompletedProcess) -> None:
  """The command exited 0, printed what its script prints when it did its job, and nothing
  that reads like a failure (`NOT_FAILURES`)."""
  output = result.stdout + result.stderr
  assert result.returncode == 0, output[-5000:]
  assert re.search(EXPECTED_OUTPUT[script_of(command)], result.stdout,
                   flags=re.M), output[-3000:]
  for notice in NOT_FAILURES:
    assert not re.search(notice, output), (notice, output[:3000])
  if "-m trainer.distributed.launch" in command:  # Python's INFO logs come from process 0 only.
    info = r"^\[process {}\] I\d{{4}} [\d:.]+ +\d+ \S+\.py:\d+\]"
    assert re.search(info.format(0), result.stdout, flags=re.M), output[-3000:]
    assert not re.search(info.format(1), result.stdout, flags=re.M), output[-3000:]


def _serves_the_study(command, runner):
  """Starts the documented optuna-dashboard on a free loopback port and reads the study's
  trials through its API."""
  import socket
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
  server = runner.popen(command, extra=["--host", "127.0.0.1", "--port", str(port)])
  try:
    deadline, studies = time.monotonic() + 120, None
    while studies is None and time.monotonic() < deadline:
      assert server.poll() is None, server.stdout.read()[-3000:]
      try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies",
                                    timeout=10) as response:
          studies = json.load(response)["study_summaries"]
      except OSError:
        time.sleep(0.5)
    assert studies, "optuna-dashboard did not answer within 120 s"
    (study,) = [s for s in studies if s["study_name"] == "sweep"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/studies/{study['study_id']}",
                                timeout=30) as response:
      trials = json.load(response)["trials"]
    few = int(FEW_STEPS_FOR_CONFIG["configs/mnist_study.py"][0].split("=")[1])
    assert len(trials) == few and all(t["intermediate_values"] for t in trials), trials[:2]
    assert {p["name"] for t in trials for p in t["params"]} == {
        "learning_rate", "momentum", "weight_decay"}
  finally:
    server.terminate()
    server.wait(timeout=30)


def _serves_the_logged_scalars(command, runner):
  """Starts the documented TensorBoard on a free loopback port and reads the run's tags."""
  logdir = runner.path(re.search(r"--logdir\s+/tmp/(\S+)", command).group(1))
  assert list(logdir.glob("events.out.tfevents.*")), f"no event file in {logdir}"
  server = runner.popen(command, extra=["--port", "0"])
  try:
    url, deadline = None, time.monotonic() + 120
    while url is None and time.monotonic() < deadline:
      line = server.stdout.readline()
      assert line or server.poll() is None, "tensorboard exited before serving"
      match = re.search(r"TensorBoard \S+ at (http://localhost:\d+/)", line)
      url = match and match.group(1)
    assert url, "tensorboard did not report its address within 120 s"
    tags = {}
    for _ in range(60):  # The run's event file is loaded in the background.
      with urllib.request.urlopen(url + "data/plugin/scalars/tags", timeout=10) as response:
        tags = json.load(response)
      if any("train/loss" in run_tags for run_tags in tags.values()):
        break
      time.sleep(1)
    assert any({"train/loss", "eval/ensemble_accuracy"} <= set(run_tags)
               for run_tags in tags.values()), tags
  finally:
    server.terminate()
    server.wait(timeout=30)
