"""One run per workdir: a lock file that a second run started there is refused by.

A resubmitted job while the first still runs, or a typo in `--workdir`, would
otherwise write checkpoints and `metrics.jsonl` over another run's. `held(dir)`
takes `<dir>/run.lock` for the length of a run: a JSON record of the host, the
pid, the start time and the launch (`launch_id`). A second run that finds it
is refused before it restores or computes anything, with an error naming the
holder. The lock is given back when the run ends; one left by a killed run
is stale and taken over with a log line when its process is gone (same host)
or when it belongs to the same launch (an attempt of `trainer.distributed.launch
--max_restarts`, or the same SLURM job requeued). A lock written on another host
cannot be checked from here: the error says to delete it if that run is gone.
On a multi-process run, process 0 holds the lock for all of them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid

import jax

from trainer.distributed.agree import any_process
from trainer.distributed.launch import LAUNCH_ENV  # One value for all its attempts.

#: The lock's file name in the run's directory.
LOCK_NAME = "run.lock"
_OWN_LAUNCH = uuid.uuid4().hex  # A process started by hand is a launch of its own.


class WorkdirInUseError(RuntimeError):
  """Another run holds the lock of the directory this run would write to."""


def launch_id() -> str:
  """This process's launch: the launcher's id, else the SLURM job's, else its own."""
  if os.environ.get(LAUNCH_ENV):
    return os.environ[LAUNCH_ENV]
  if os.environ.get("SLURM_JOB_ID"):
    return f"slurm-{os.environ['SLURM_JOB_ID']}"
  return _OWN_LAUNCH


def _record() -> dict:
  return {"host": socket.gethostname(), "pid": os.getpid(), "launch_id": launch_id(),
          "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # Someone else's process.
  return True


def _read(path: str) -> dict | None:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _stale(holder: dict | None, ours: dict) -> str | None:
  """Why the lock `holder` may be taken over, or None if its run may still be going."""
  if holder is None:
    return "it is unreadable"
  if holder.get("launch_id") == ours["launch_id"]:
    return f"it belongs to this launch ({ours['launch_id']}), an earlier attempt"
  if holder.get("host") == ours["host"] and not _alive(int(holder.get("pid", -1))):
    return f"its process {holder.get('pid')} is gone"
  return None


def acquire(directory: str) -> str:
  """Takes `<directory>/run.lock`; returns its path.

  Raises:
    WorkdirInUseError: another run holds it, naming the holder.
  """
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, LOCK_NAME)
  ours = _record()
  try:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    holder = _read(path)
    why = _stale(holder, ours)
    if why is None:
      where = ("" if holder.get("host") == ours["host"] else
               " (another host: its process cannot be checked from here; delete the file "
               "if that run is gone)")
      raise WorkdirInUseError(
          f"{directory} is in use by another run: pid {holder.get('pid')} on host "
          f"{holder.get('host')}, started {holder.get('started')}, launch "
          f"{holder.get('launch_id')}{where}. A second run there would write its checkpoints "
          f"and metrics over that run's: choose another directory, or stop that run "
          f"(its lock: {path}).") from None
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
      json.dump(ours, f)
    os.replace(tmp, path)  # Atomic: a run reading it sees the old record or ours.
    if _read(path) != ours:
      raise WorkdirInUseError(f"{directory}: another run took over the stale lock {path} "
                              f"at the same time: {_read(path)}.") from None
    logging.warning("Took over the stale lock %s of %s: %s.", path, holder, why)
    return path
  with os.fdopen(fd, "w") as f:
    json.dump(ours, f)
  return path


def release(path: str) -> None:
  """Removes the lock if it is still this process's."""
  if (_read(path) or {}).get("pid") == os.getpid():
    with contextlib.suppress(FileNotFoundError):
      os.remove(path)


@contextlib.contextmanager
def held(directory: str | None):
  """The lock of `directory` while the block runs (nothing when `directory` is None).

  On a multi-process run process 0 takes it for all of them, and every process learns
  whether it got it: a refusal stops them all, so none goes on into a collective alone.
  """
  if directory is None:
    yield
    return
  directory = os.path.abspath(directory)
  path, refusal, made = None, None, False
  if jax.process_index() == 0:
    made = not os.path.exists(directory)
    try:
      path = acquire(directory)
    except WorkdirInUseError as e:
      refusal = e
  if any_process(refusal is not None):
    raise refusal or WorkdirInUseError(
        f"{directory} is in use by another run: process 0 was refused its lock "
        f"({os.path.join(directory, LOCK_NAME)}) and says why.")
  try:
    yield
  finally:
    if path is not None:
      release(path)
      if made:  # A run refused before it wrote anything leaves no directory behind.
        with contextlib.suppress(OSError):
          os.rmdir(directory)
