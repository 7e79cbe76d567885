"""`<workdir>/status.json`: whether a run is running, finished, stopped or failed, for a
script to read (the exit status is 0 both for a finished run and for one stopped by
SIGTERM or Ctrl-C with a checkpoint, as a scheduler's preemption expects).

`RecordStatus` writes it on process 0: `running` before the first step, and after the
last step `finished` (it reached the run's steps) or `stopped` (a signal, early
stopping: `stopped_by` says which), with the step reached; `failed` when the loop ended
by an error. A run killed outright (SIGKILL, the OOM killer) leaves `running`, and the
`pid` says which process it was.
"""

from __future__ import annotations

import json
import os

import jax

from trainer.loop.actions import Action, StepView

STATUS_NAME = "status.json"


class RecordStatus(Action):
  """Writes `<workdir>/status.json` (module docstring); the last of the built-in actions."""

  def __init__(self, workdir: str):
    super().__init__(every_steps=0)
    self.path = os.path.join(workdir, STATUS_NAME)
    self._ended, self._step, self._num_steps = False, 0, 0

  def _write(self, **status) -> None:
    if jax.process_index() != 0:
      return
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    tmp = f"{self.path}.tmp"
    with open(tmp, "w") as f:
      json.dump({**status, "pid": os.getpid()}, f)
    os.replace(tmp, self.path)  # A reader never sees half a file.

  def begin(self, view: StepView) -> None:
    self._step, self._num_steps = view.step, view.num_steps
    self._write(status="running", step=view.step, num_steps=view.num_steps)

  def end(self, view: StepView) -> None:
    from trainer.sweep.report import FINISHED  # A sweep that chose: its run is complete.
    self._ended = True
    stopped = view.stop_reason not in (None, FINISHED)
    self._write(status="stopped" if stopped else "finished", step=view.step,
                num_steps=view.num_steps, stopped_by=view.stop_reason if stopped else None)

  def close(self) -> None:
    if not self._ended:
      self._write(status="failed", step=None, num_steps=self._num_steps,
                  started_at=self._step)
