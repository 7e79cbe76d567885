"""Where a run's wall time goes (goodput), and a watchdog for when it stops going anywhere.

`LoopClock` accounts every second of the loop to one category: `compile`
(the first call of each compiled program, until its results are ready), `data`
(reading and placing host batches), `train` (dispatching calls and waiting for them), `eval`,
`checkpoint`, `other` (the other actions), and the time before the loop:
`startup` (process start, data, init, compilation of eval), or `restart`
when the run resumed from a checkpoint. Measurements nest: time in an inner
category is not counted again in the outer one. `goodput` is the `train`
fraction. The totals are kept in the checkpoints (`ReportMetrics`' state), so
they add up over every attempt of a run that resumes.

`Watchdog` exits the process when no call or action finishes within its
limit (`config.watchdog_seconds`; compilation, evaluation and checkpoints get
`config.watchdog_slow_seconds`): it writes every thread's stack to the log
(`faulthandler`), removes half-written checkpoints and exits with
`WATCHDOG_EXIT_CODE`, a failure the launcher (`--max_restarts`) and cluster
schedulers restart.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

#: The categories of the loop's wall time, in report order.
CATEGORIES = ("train", "compile", "data", "eval", "checkpoint", "other", "startup", "restart")
#: Categories the watchdog gives its slow limit.
SLOW = ("compile", "eval", "checkpoint")
#: The exit status of a process the watchdog ended (sysexits' EX_TEMPFAIL: try again).
WATCHDOG_EXIT_CODE = 75


def process_seconds() -> float:
  """Seconds since this program's own work began: since the `trainer` package was first
  imported. (Not since the process began: a shell that runs Python as its last command,
  `bash -c "pip install ... && python ..."`, gives it its own process, and the install's
  minutes would count as this run's startup.)"""
  import trainer
  return time.monotonic() - trainer.IMPORTED


_LAST_LOOP_END: float | None = None


def startup_seconds() -> float:
  """The time before this loop: since the process started, or since the last loop in this
  process ended (a second `fit`)."""
  if _LAST_LOOP_END is None:
    return process_seconds()
  return time.monotonic() - _LAST_LOOP_END


def mark_loop_end() -> None:
  global _LAST_LOOP_END
  _LAST_LOOP_END = time.monotonic()


class LoopClock:
  """Exclusive wall time per category (`CATEGORIES`), from the loop's measurements."""

  def __init__(self):
    self.seconds = dict.fromkeys(CATEGORIES, 0.0)
    self._stack: list[list] = []  # [category, seconds spent in nested measurements]
    self.watchdog: Watchdog | None = None

  @contextlib.contextmanager
  def measure(self, category: str):
    """Counts the time inside to `category`, less any nested measurement's time."""
    entry = [category, 0.0]
    self._stack.append(entry)
    if self.watchdog:
      self.watchdog.enter(category)
    start = time.perf_counter()
    try:
      yield
    finally:
      elapsed = time.perf_counter() - start
      self._stack.pop()
      self.seconds[category] += elapsed - entry[1]
      if self._stack:
        self._stack[-1][1] += elapsed
      if self.watchdog:
        self.watchdog.leave(self._stack[-1][0] if self._stack else None)

  def add(self, category: str, seconds: float) -> None:
    self.seconds[category] += seconds

  def fractions(self) -> dict[str, float]:
    total = sum(self.seconds.values())
    return {k: (v / total if total else 0.0) for k, v in self.seconds.items()}

  def describe(self) -> str:
    """`train 61%, compile 22%, ...` (the nonzero categories) and the total."""
    total = sum(self.seconds.values())
    parts = [f"{k} {v:.0%}" for k, v in self.fractions().items() if self.seconds[k] > 0]
    return f"{', '.join(parts)} of {total:.1f} s"

  def state_dict(self) -> dict[str, float]:
    return dict(self.seconds)

  def load_state_dict(self, saved: dict[str, float]) -> None:
    """Adds an earlier attempt's totals (from the checkpoint this run resumes)."""
    for k, v in saved.items():
      if k in self.seconds:
        self.seconds[k] += float(v)


class Watchdog:
  """Ends the process when the loop makes no progress within its limit.

  Args:
    seconds: the limit for a train call or an action.
    slow_seconds: the limit inside `SLOW` categories (compilation, evaluation,
      checkpoints).
    cleanup: called before exiting (removes half-written checkpoints).
    exit: how the process ends (tests replace it).
  """

  def __init__(self, seconds: float, slow_seconds: float, *,
               cleanup: Callable[[], None] = lambda: None,
               exit: Callable[[int], None] = os._exit):
    self.seconds, self.slow_seconds = seconds, slow_seconds
    self.cleanup, self._exit = cleanup, exit
    self._limit: float | None = None  # None: not armed (before the loop, after it).
    self._since = time.monotonic()
    self._where = "before the first step"
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    self._done.set()

  def enter(self, category: str) -> None:
    self._set(category)

  def leave(self, category: str | None) -> None:
    """A measurement ended (progress); the enclosing one's limit applies again."""
    self._set(category or "the loop")

  def _set(self, category: str) -> None:
    self._since = time.monotonic()
    self._where = category
    self._limit = self.slow_seconds if category in SLOW else self.seconds

  def _watch(self) -> None:
    while not self._done.wait(min(1.0, self.seconds / 4)):
      limit = self._limit
      if limit is not None and time.monotonic() - self._since > limit:
        self._fire(limit)
        return

  def _fire(self, limit: float) -> None:
    logging.error("Watchdog: nothing finished for %g s in %s (config.watchdog_seconds=%s, "
                  "watchdog_slow_seconds=%s); every thread's stack follows, then the process "
                  "exits with status %d.", limit, self._where, self.seconds, self.slow_seconds,
                  WATCHDOG_EXIT_CODE)
    for handler in logging.getLogger().handlers:
      handler.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    try:
      self.cleanup()
    finally:
      self._exit(WATCHDOG_EXIT_CODE)
