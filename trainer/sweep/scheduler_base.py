"""What every sweep scheduler shares: the `Decision` it returns at an evaluation, and the
`Scheduler` base class, which keeps the history (one record per trial, the run's events),
refills freed slots and saves and restores itself. The schedulers themselves
(`trainer.sweep.schedulers`: halving and PBT; `trainer.sweep.study`: an Optuna study)
subclass it and decide; nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trainer.sweep.members import Sweep


@dataclasses.dataclass(frozen=True)
class Decision:
  """What a scheduler chose at one evaluation.

  Attributes:
    step: the step of the evaluation.
    refill: slot -> the trial that starts in it now, fresh from its seed.
    copy: slot -> the slot whose state it takes now (PBT's exploit).
    values: slot -> the hyperparameters it trains with from now on (every slot
      that was refilled or copied).
    frozen: the slots whose updates are masked from now on (nothing left to try).
    export: `(slot, trial)` of a completed trial to export before its slot is
      refilled (it is the best completed one so far), else None.
    finished: every trial has stopped or completed: the run can end.
  """

  step: int
  refill: Mapping[int, int] = dataclasses.field(default_factory=dict)
  copy: Mapping[int, int] = dataclasses.field(default_factory=dict)
  values: Mapping[int, Mapping[str, float]] = dataclasses.field(default_factory=dict)
  frozen: tuple[int, ...] = ()
  export: tuple[int, int] | None = None
  finished: bool = False

  @property
  def changes_state(self) -> bool:
    return bool(self.refill or self.copy or self.frozen)


def _badness(value: float, mode: str) -> float:
  """Smaller is better; NaN is worst."""
  if not np.isfinite(value):
    return math.inf
  return -value if mode == "max" else value


class Scheduler:
  """The history every scheduler keeps: one record per trial (which configuration held
  which slot from which step to which, its metric at each evaluation) and the run's
  events (stops, refills, copies, freezes).

  Args:
    sweep: the configurations (`Sweep.members`) and their labels.
    slots: the ensemble's member count.
    budget: the steps a trial trains at most (its single run's length).
    mode: 'max' or 'min' (`config.sweep.mode`).
  """

  name = ""

  @property
  def rounds(self) -> int:
    """How many trials' budgets the program may need end to end (`program_steps`)."""
    return 1

  def __init__(self, sweep: Sweep, *, slots: int, budget: int, mode: str):
    self.sweep, self.num_slots, self.budget, self.mode = sweep, slots, budget, mode
    #: The trial in each slot, None once the slot is frozen.
    self.slots: list[int | None] = list(range(slots))
    #: The step each slot's trial started at.
    self.start: list[int] = [0] * slots
    #: Each slot's hyperparameters now.
    self.values: list[dict[str, float]] = [dict(sweep.members[i]) for i in range(slots)]
    #: One record per trial that has held a slot, in the order they started.
    self.trials: list[dict[str, Any]] = self._first_records()
    #: Every stop, refill, copy and freeze: `{step, event, slot, ...}`.
    self.events: list[dict[str, Any]] = []

  def _first_records(self) -> list[dict[str, Any]]:
    """Configuration i in slot i from step 0 (a study asks its first trials at `start`)."""
    return [self._record(i, i, 0) for i in range(self.num_slots)]

  def _record(self, trial: int, slot: int, step: int) -> dict[str, Any]:
    return {"trial": trial, "label": self.sweep.label(trial), "slot": slot, "start": step,
            "end": None, "status": "running", "values": dict(self.sweep.values(trial)),
            "curve": []}

  def seed_of(self, trial: int) -> int:
    """The seed configuration `trial` starts from."""
    return int(self.sweep.values(trial)["seed"])

  def first_trials(self, step: int) -> bool:
    """Before the run's first call: True when the slots' values changed (a study asks its
    first trials here); the grid's and the schedulers' are in the state from its init."""
    del step
    return False

  def should_export(self, record: Mapping[str, Any]) -> bool:
    """Whether the best trial's record is exported at the end (a study's: only its best)."""
    del record
    return True

  def on_export(self, trial: int, directory: str) -> None:
    """Called once `trial` is exported to `directory`."""

  def finish(self, step: int) -> None:
    """After the run's summary."""

  def summary(self) -> dict[str, Any] | None:
    """What `sweep.json` records besides the trials (a study's name, states, best)."""
    return None

  def _next_trial(self, slot: int, step: int) -> int | None:
    """The trial that starts in freed slot `slot` at `step`, or None: nothing left (the
    schedulers that refill slots say which)."""
    raise NotImplementedError(f"scheduler {self.name!r} does not refill slots")

  def _refill(self, freed: Sequence[int], step: int) -> tuple[dict[int, int], list[int]]:
    """Starts the next trial (`_next_trial`) in each freed slot, or freezes the slot when
    none is left; `(slot -> trial started, slots frozen)`, both recorded as events."""
    refill: dict[int, int] = {}
    frozen: list[int] = []
    for slot in sorted(freed):
      trial = self._next_trial(slot, step)
      if trial is None:
        frozen.append(slot)
        self.slots[slot] = None
        self.events.append({"step": step, "event": "freeze", "slot": slot})
        continue
      refill[slot] = trial
      self.slots[slot], self.start[slot] = trial, step
      self.values[slot] = dict(self.sweep.values(trial))
      self.trials.append(self._record(trial, slot, step))
      self.events.append({"step": step, "event": "refill", "slot": slot, "trial": trial,
                          "label": self.sweep.label(trial)})
    return refill, frozen

  def _end(self, record: dict[str, Any], step: int, status: str, slot: int,
           **why: Any) -> None:
    """Ends the trial of `record` in `slot` at `step` as `status`, with an event."""
    record["end"], record["status"] = step, status
    self.events.append({"step": step, "event": status, "slot": slot,
                        "trial": record["trial"], "label": record["label"], **why})

  def current(self, slot: int) -> dict[str, Any] | None:
    """The record of the trial running in `slot` (None: frozen)."""
    for record in reversed(self.trials):
      if record["slot"] == slot and record["end"] is None:
        return record
    return None

  def last_record(self, slot: int) -> dict[str, Any]:
    """The record of the last trial that held `slot` (whose state the slot holds)."""
    return next(r for r in reversed(self.trials) if r["slot"] == slot)

  def labels(self) -> list[str | None]:
    """Each slot's trial label now (None: frozen), for its metrics' names."""
    return [None if (r := self.current(s)) is None or r["status"] != "running"
            else r["label"] for s in range(self.num_slots)]

  def observe(self, step: int, values: Sequence[float]) -> Decision:
    """Records each slot's metric at an evaluation of `step` and decides."""
    for slot, value in enumerate(values):
      record = self.current(slot)
      if record is not None and record["status"] == "running":
        record["curve"].append([step, step - self.start[slot], float(value)])
    return self.decide(step, [float(v) for v in values])

  def set_budget(self, budget: int) -> None:
    """Sets the trials' length (`fit`'s num_steps, known when the run begins)."""
    self.budget = budget

  def observe_only(self, step: int, values: Sequence[float]) -> None:
    """Records each slot's metric at the run's last evaluation; a trial that ran its
    budget there is completed (one cut short stays 'running')."""
    for slot, value in enumerate(values):
      record = self.current(slot)
      if record is not None and record["status"] == "running":
        record["curve"].append([step, step - self.start[slot], float(value)])
        if step - self.start[slot] >= self.budget:
          record["end"], record["status"] = step, "completed"

  def decide(self, step: int, values: list[float]) -> Decision:
    """A grid decides nothing: every member trains to the end."""
    del values
    return Decision(step)

  def next_due(self, step: int) -> int | None:
    """The first step after `step` at which a running trial ends its budget (the
    scheduler must see the run there, evaluation or not), or None."""
    ends = [self.start[slot] + self.budget for slot, trial in enumerate(self.slots)
            if trial is not None and self.start[slot] + self.budget > step]
    return min(ends) if ends and self.name else None

  def model_steps(self, step: int) -> int:
    """Updates that trained a running trial, summed over slots, up to `step`."""
    return sum((r["end"] if r["end"] is not None else step) - r["start"] for r in self.trials)

  def state_dict(self) -> dict[str, Any]:
    return {"slots": self.slots, "start": self.start, "values": self.values,
            "trials": self.trials, "events": self.events}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    self.slots, self.start = list(state["slots"]), list(state["start"])
    self.values = [dict(v) for v in state["values"]]
    self.trials, self.events = list(state["trials"]), list(state["events"])

  def best_trial(self) -> dict[str, Any] | None:
    """The record of the best trial: among those that completed their budget (all of
    them where none did), the best last metric."""
    scored = [r for r in self.trials if r["curve"]]
    done = [r for r in scored if r["status"] == "completed"] or scored
    if not done:
      return None
    return min(done, key=lambda r: (_badness(r["curve"][-1][2], self.mode), r["trial"]))
