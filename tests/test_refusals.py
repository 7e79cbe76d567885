"""A refusal is read by a person: the commands print its message alone (`<program>:
<message>`), with no traceback, and exit with status 1; `--verbosity=1` shows the
traceback (`trainer.config.run`)."""

import subprocess
import sys

import pytest

from trainer import config as config_lib

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
PY = sys.executable


def _run(args, cwd=ROOT):
  return subprocess.run([PY, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def _alone(run, program, message):
  """The run refused: status 1, its last line the message, and no traceback."""
  assert run.returncode == 1, run.stderr[-3000:]
  last = run.stderr.strip().splitlines()[-1]
  assert last.startswith(f"{program}: ") and message in last, run.stderr[-3000:]
  assert "Traceback" not in run.stderr, run.stderr[-3000:]


@pytest.mark.parametrize("args,program,message", [
    (["examples/finetune_lm.py", "--config.num_train_steps=4"], "finetune_lm.py",
     "config.schedule.name='cosine' decays over the run, so it needs the run's length: "
     "num_train_steps=4 must exceed config.schedule.warmup_steps=10."),
    (["examples/rl_lm.py", "--config.rl.rewards=('examples/rl_tasks.py:no_such_reward',)"],
     "rl_lm.py", "the file examples/rl_tasks.py has no 'no_such_reward'"),
    (["-m", "trainer.export", "--out=/tmp/unused"], "trainer.export",
     "config.json' does not exist: the export needs the run's config.model"),
])
def test_a_refusal_prints_its_message_alone(tmp_path, args, program, message):
  workdir = [f"--workdir={tmp_path / 'work'}"]
  _alone(_run([*args, *workdir]), program, message)


def test_a_reward_that_cannot_take_the_records_is_refused_alone(tmp_path):
  """A TRL reward reading `answer` from records that have none: refused when the trainer is
  built, with the reward's own message, before anything compiles."""
  run = _run(["examples/rl_lm.py", f"--workdir={tmp_path}",
              "--config.rl.rewards=('tests/rl_rewards.py:correct',)"])
  _alone(run, "rl_lm.py", "the reward function 'correct' (tests/rl_rewards.py:correct) "
                          "raised TypeError")
  assert "missing 1 required positional argument: 'answer'" in run.stderr
  assert "compiled" not in run.stderr


def test_verbosity_1_shows_the_traceback(tmp_path):
  run = _run(["examples/finetune_lm.py", f"--workdir={tmp_path}",
              "--config.num_train_steps=4", "--verbosity=1"])
  assert run.returncode != 0
  assert "Traceback" in run.stderr and "ValueError: config.schedule.name='cosine'" in run.stderr


def test_what_counts_as_a_refusal():
  from trainer.checkpoint.checks import CheckpointError
  from trainer.loop.driver import NonFiniteError
  from trainer.run.lock import WorkdirInUseError
  for error in (ValueError("x"), FileNotFoundError("x"), CheckpointError("x"),
                NonFiniteError("x"), WorkdirInUseError("x")):
    assert config_lib.is_refusal(error), error
  for error in (KeyError("x"), TypeError("x"), RuntimeError("x"), AssertionError()):
    assert not config_lib.is_refusal(error), error  # A bug keeps its traceback.
