"""Runs a command in a process group of its own and says which of its processes are left:
how the tests check that a run ends by itself, with no worker left behind."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time


def start(command: list[str], **kwargs) -> subprocess.Popen:
  """`command` in a new session (its own process group, as a terminal's job), its output
  (stdout and stderr together) a text pipe."""
  return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True, **kwargs)


def alive_in_group(group: int) -> list[int]:
  """The processes of process group `group` that are alive (zombies, which have ended and
  wait only to be reaped, are not)."""
  alive = []
  for entry in pathlib.Path("/proc").iterdir():
    if not entry.name.isdigit():
      continue
    try:
      fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # Gone meanwhile.
      continue
    state, pgrp = fields[0], int(fields[2])
    if pgrp == group and state not in ("Z", "X"):
      alive.append(int(entry.name))
  return alive


def left_after(group: int, seconds: float = 15.0) -> list[int]:
  """The processes of `group` still alive after up to `seconds` (a worker that checks for
  its parent twice a second, and multiprocessing's resource tracker, end shortly after
  the process that started them)."""
  deadline = time.monotonic() + seconds
  while (alive := alive_in_group(group)) and time.monotonic() < deadline:
    time.sleep(0.2)
  return alive


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int | None, str]:
  """Waits up to `timeout` seconds for `proc` to end by itself; returns its status (None:
  it had not ended, and its group is killed) and its output."""
  try:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    return None, out


def run(command: list[str], timeout: float, **kwargs) -> tuple[int | None, str, list[int]]:
  """Runs `command` to its end (or `timeout`): its status (None: still running at the
  timeout), its output, and the processes of its group left alive after it."""
  proc = start(command, **kwargs)
  rc, out = finish(proc, timeout)
  return rc, out, left_after(proc.pid)


def interrupt_after(proc: subprocess.Popen, marker: str, timeout: float
                    ) -> tuple[int | None, str, list[int]]:
  """Sends SIGINT to `proc`'s whole group (as a terminal's Ctrl-C does) once a line of its
  output contains `marker`, then waits up to `timeout` seconds for it to end: its status
  (None: it did not end), its output, and its group's processes left alive."""
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if marker in line:
      os.killpg(proc.pid, signal.SIGINT)
      break
  rc, rest = finish(proc, timeout)
  return rc, "".join(lines) + rest, left_after(proc.pid)
