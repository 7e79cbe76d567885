"""What a run says when it stops: `<workdir>/status.json` (finished, stopped, failed, for
a script) and the examples' own lines (a run stopped by Ctrl-C says where it stopped)."""

import json
import pathlib
import re
import sys

import processes
import pytest
from conftest import MLPTrainer, mlp_config, vector_batches

from trainer.loop.actions import PeriodicCallback

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _status(workdir):
  return json.loads((workdir / "status.json").read_text())


def test_a_finished_run_says_finished(tmp_path):
  trainer = MLPTrainer(mlp_config(num_train_steps=3))
  trainer.fit(vector_batches(3, 16, 8), num_steps=3, workdir=str(tmp_path))
  status = _status(tmp_path)
  assert (status["status"], status["step"], status["num_steps"]) == ("finished", 3, 3)


def test_a_run_that_raised_says_failed(tmp_path):
  def fail(view):
    if view.step == 2:
      raise RuntimeError("a bug in an action")

  trainer = MLPTrainer(mlp_config(num_train_steps=4))
  with pytest.raises(RuntimeError, match="a bug in an action"):
    trainer.fit(vector_batches(4, 16, 8), num_steps=4, workdir=str(tmp_path),
                actions=[PeriodicCallback(fail, every_steps=1)])
  assert _status(tmp_path)["status"] == "failed"


def test_an_rl_run_stopped_by_ctrl_c_says_where_it_stopped(tmp_path):
  """The addition example (400 steps), Ctrl-C to its group once a step has compiled: it
  stops with a checkpoint, prints where it stopped and the figures of that step, exits 0,
  and its status says `stopped` by SIGINT at that step."""
  work = tmp_path / "work"
  proc = processes.start([sys.executable, str(ROOT / "examples" / "rl_lm.py"),
                          f"--workdir={work}"], cwd=ROOT)
  rc, out, left = processes.interrupt_after(proc, "Train step compiled", timeout=300)
  assert rc == 0, out[-4000:]
  stopped = re.search(r"stopped at step (\d+) of 400 \(SIGINT\)", out)
  assert stopped, out[-4000:]
  step = int(stopped.group(1))
  assert 0 < step < 400
  assert re.search(rf"held-out mean reward: before=\S+ after=\S+ \({step} steps of 32 "
                   rf"prompts", out), out[-4000:]
  status = _status(work)
  assert (status["status"], status["step"], status["stopped_by"]) == ("stopped", step, "SIGINT")
  assert (work / "checkpoints" / str(step)).is_dir()
  assert left == []
