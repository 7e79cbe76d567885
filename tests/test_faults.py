"""Faults an unattended run meets, injected into real orbax checkpoints on disk: an unreadable
latest checkpoint (`config.checkpoint.on_corrupt`), a save that fails with ENOSPC
(`config.checkpoint.on_save_error`), and a second run in the same workdir (`trainer.run.lock`)."""

import errno
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import process_cache
import pytest
from conftest import MLPTrainer, leaves, mlp_config, vector_batches
from etils import epath

from trainer.checkpoint import Checkpointer, CheckpointError, CorruptCheckpointError
from trainer.run import lock

STEPS = 8
BATCHES = vector_batches(STEPS, 16, 8)


def _run(ckpt, num_steps=STEPS):
  trainer = MLPTrainer(mlp_config())
  state = trainer.fit(lambda start: BATCHES[start:], num_steps=num_steps, checkpointer=ckpt).state
  return leaves(trainer.strategy.to_canonical(state))


_STRAIGHT = []


def _straight():
  if not _STRAIGHT:
    _STRAIGHT.append(_run(None))
  return _STRAIGHT[0]


def _corrupt(step_dir: str, how: str) -> None:
  if how == "truncated arrays":
    files = glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
    assert files
    for f in files:
      with open(f, "r+b") as fh:
        fh.truncate(7)
  elif how == "no commit marker":  # Orbax did not finalize the step.
    os.remove(os.path.join(step_dir, "commit_success.txt"))
  elif how == "lost layout":
    shutil.rmtree(os.path.join(step_dir, "layout"))


@pytest.mark.parametrize("how", ["truncated arrays", "no commit marker", "lost layout"])
def test_an_unreadable_latest_checkpoint_is_set_aside_and_the_run_resumes_before_it(tmp_path,
                                                                                    how, caplog):
  directory = tmp_path / "checkpoints"
  ckpt = Checkpointer(directory, every_steps=2)
  _run(ckpt, num_steps=6)
  ckpt.close()
  _corrupt(str(directory / "6"), how)
  files_before = sorted(os.path.relpath(p, directory / "6")
                        for p in glob.glob(str(directory / "6" / "**"), recursive=True))

  ckpt = Checkpointer(directory, every_steps=2)
  resumed = _run(ckpt)
  ckpt.close()
  for got, want in zip(resumed, _straight(), strict=True):
    np.testing.assert_array_equal(got, want)  # Resumed from step 4: nothing lost.
  aside = glob.glob(str(directory / "6.corrupt-*"))
  assert len(aside) == 1  # Renamed, never deleted: every file is still there.
  assert sorted(os.path.relpath(p, aside[0]) for p in
                glob.glob(os.path.join(aside[0], "**"), recursive=True)) == files_before
  assert "Checkpoint step 6 is unreadable" in caplog.text and aside[0] in caplog.text
  assert Checkpointer(directory).all_steps()[-1] == STEPS


def test_on_corrupt_error_raises_and_moves_nothing_and_a_requested_step_always_raises(tmp_path):
  directory = tmp_path / "checkpoints"
  ckpt = Checkpointer(directory, every_steps=2)
  _run(ckpt, num_steps=4)
  ckpt.close()
  _corrupt(str(directory / "4"), "truncated arrays")
  with pytest.raises(CorruptCheckpointError, match=r"checkpoint step 4 in .* is unreadable"):
    _run(Checkpointer(directory, on_corrupt="error"))
  # Asked for by step, an unreadable checkpoint is an error under either setting.
  trainer = MLPTrainer(mlp_config())
  with pytest.raises(CorruptCheckpointError, match="step 4"):
    trainer.restore_checkpoint(Checkpointer(directory), BATCHES[0], step=4)
  assert sorted(os.listdir(directory)) == ["2", "4"]


def test_a_checkpoint_of_another_model_is_an_error_not_a_fallback(tmp_path):
  directory = tmp_path / "checkpoints"
  ckpt = Checkpointer(directory, every_steps=2)
  _run(ckpt, num_steps=4)
  ckpt.close()
  other = MLPTrainer(mlp_config(**{"model.depth": 32}))
  with pytest.raises(CheckpointError, match="does not fit the model") as e:
    other.fit(lambda start: BATCHES[start:], num_steps=STEPS, checkpointer=Checkpointer(directory))
  assert not isinstance(e.value, CorruptCheckpointError)
  assert sorted(os.listdir(directory)) == ["2", "4"]  # Nothing set aside.


@pytest.fixture
def disk_full_at(monkeypatch):
  """The steps whose checkpoint write fails with ENOSPC (a set: add to it, clear it), in
  orbax's own background write (its JSON item, written through etils' epath)."""
  cls = type(epath.Path("/"))
  write_text = cls.write_text
  failing = set()

  def write(self, *args, **kwargs):
    path = str(self)
    if any(f"/{s}.orbax-checkpoint-tmp/" in path for s in failing) and path.endswith("metadata"):
      raise OSError(errno.ENOSPC, "No space left on device", path)
    return write_text(self, *args, **kwargs)

  monkeypatch.setattr(cls, "write_text", write)
  return failing


def test_a_failed_save_stops_the_run_naming_the_step_and_keeps_the_one_before(tmp_path,
                                                                              disk_full_at):
  directory = tmp_path / "checkpoints"
  disk_full_at.add(4)
  failing = Checkpointer(directory, every_steps=2, on_save_error="stop")
  with pytest.raises(CheckpointError) as e:
    _run(failing)
  failing.close()  # The error was raised once; closing waits for nothing more.
  message = str(e.value)
  assert "checkpoint step 4" in message and str(directory) in message
  assert "No space left on device" in message and "step 2, is untouched" in message
  ckpt = Checkpointer(directory, every_steps=2)
  assert ckpt.all_steps() == [2]
  trainer = MLPTrainer(mlp_config())
  trainer.restore_checkpoint(ckpt, BATCHES[0], step=2)  # Loadable.
  disk_full_at.clear()  # The disk has room again: resumed from 2, nothing else lost.
  resumed = _run(ckpt)
  ckpt.close()
  for got, want in zip(resumed, _straight(), strict=True):
    np.testing.assert_array_equal(got, want)


def test_a_failed_save_under_continue_is_logged_and_the_next_save_lands(tmp_path, disk_full_at,
                                                                       caplog):
  directory = tmp_path / "checkpoints"
  disk_full_at.add(4)
  ckpt = Checkpointer(directory, every_steps=2, on_save_error="continue")
  final = _run(ckpt)
  ckpt.close()
  assert ckpt.failed_saves == [4]
  assert "writing checkpoint step 4" in caplog.text and "The run goes on" in caplog.text
  assert Checkpointer(directory).all_steps() == [2, 6, 8]
  for got, want in zip(final, _straight(), strict=True):
    np.testing.assert_array_equal(got, want)
  trainer = MLPTrainer(mlp_config())
  restored = trainer.restore_checkpoint(Checkpointer(directory), BATCHES[0], step=6)
  assert int(restored.step) == 6


# -- One run per workdir ------------------------------------------------------------------------

RESUME_RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resume_run.py")


def _resume_run(workdir, *args):
  return [sys.executable, RESUME_RUN, f"--workdir={workdir}", "--strategy=single_device",
          f"--out={workdir}/final.npz", *args]


def _env(**extra):
  return process_cache.launched_env(drop=(lock.LAUNCH_ENV,), **extra)


def test_a_second_run_in_a_workdir_is_refused_naming_the_first(tmp_path):
  workdir = tmp_path / "work"
  first = subprocess.Popen(_resume_run(workdir, "--steps=2000", "--every=1000",
                                       "--batch_delay=0.05"),
                           env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
  try:
    deadline = time.monotonic() + 120
    while not (workdir / lock.LOCK_NAME).exists():
      assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
      time.sleep(0.2)
    second = subprocess.run(_resume_run(workdir, "--steps=4"), env=_env(),
                            capture_output=True, text=True, timeout=300)
    assert second.returncode != 0
    assert f"is in use by another run: pid {first.pid} on host {socket.gethostname()}" in \
        second.stderr, second.stderr[-3000:]
    assert "finished at step" not in second.stdout
    assert first.poll() is None  # The first run goes on.
    assert json.loads((workdir / lock.LOCK_NAME).read_text())["pid"] == first.pid
  finally:
    first.send_signal(signal.SIGTERM)  # Stops at a step with a checkpoint.
    first.communicate(timeout=120)
  assert first.returncode == 0
  assert not (workdir / lock.LOCK_NAME).exists()  # Given back at the end.


def _gone_pid() -> int:
  done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  return int(done.stdout)


@pytest.mark.parametrize("holder", ["killed run", "earlier attempt of this launch"])
def test_a_stale_lock_is_taken_over_with_a_log_line(tmp_path, holder):
  workdir = tmp_path / "work"
  workdir.mkdir()
  sleeper = subprocess.Popen(["sleep", "60"])
  try:
    record = {"host": socket.gethostname(), "launch_id": "launch-1", "started": "earlier",
              "pid": _gone_pid() if holder == "killed run" else sleeper.pid}
    (workdir / lock.LOCK_NAME).write_text(json.dumps(record))
    env = _env(**({lock.LAUNCH_ENV: "launch-1"} if "attempt" in holder else {}))
    done = subprocess.run(_resume_run(workdir, "--steps=4"), env=env, capture_output=True,
                          text=True, timeout=300)
  finally:
    sleeper.kill()
  assert done.returncode == 0, done.stderr[-3000:]
  assert "finished at step 4" in done.stdout
  why = "is gone" if holder == "killed run" else "belongs to this launch (launch-1)"
  assert "Took over the stale lock" in done.stderr and why in done.stderr, done.stderr[-3000:]


def test_a_live_holder_of_another_launch_is_refused_in_process(tmp_path):
  sleeper = subprocess.Popen(["sleep", "60"])
  try:
    (tmp_path / lock.LOCK_NAME).write_text(json.dumps(
        {"host": socket.gethostname(), "pid": sleeper.pid, "launch_id": "other",
         "started": "2026-11-25T00:00:00Z"}))
    ckpt = Checkpointer(tmp_path / "checkpoints", every_steps=2)
    with pytest.raises(lock.WorkdirInUseError, match=f"pid {sleeper.pid} on host"):
      MLPTrainer(mlp_config()).fit(lambda start: BATCHES[start:], num_steps=STEPS,
                                   checkpointer=ckpt, workdir=str(tmp_path))
    assert ckpt.all_steps() == []  # Refused before anything ran.
  finally:
    sleeper.kill()


def test_a_save_error_names_the_write_failure_orbax_only_logged(tmp_path):
  # A failed write can make orbax's clean-up fail next, and `save` raises that second
  # error; the first, logged by orbax's writer thread, is the cause the error names.
  import logging as py_logging
  (tmp_path / "checkpoints").mkdir()
  ckpt = Checkpointer(tmp_path / "checkpoints", every_steps=2)
  ckpt.latest_step()  # Opens orbax's manager (and the log watch) as a save does.
  py_logging.getLogger("absl").error(
      "[thread=json_ch_save] _SignalingThread.run() raised an exception: [Errno 28] No space "
      "left on device: '%s/4.orbax-checkpoint-tmp/layout/metadata'", ckpt.directory)
  cause = ckpt._cause(OSError(39, "Directory not empty"))
  assert cause.startswith("[Errno 28] No space left on device") and \
      cause.endswith("(then OSError: [Errno 39] Directory not empty)")
  ckpt.wait()  # Nothing pending: the saves so far landed, the logged failure is forgotten.
  assert ckpt._cause(OSError(39, "x")) == "OSError: [Errno 39] x"
  ckpt.close()
