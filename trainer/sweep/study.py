"""An Optuna study as a sweep's source of configurations: the ensemble's slots are the
study's concurrent trials (`config.sweep.study`).

At the start every slot asks the study for a trial (Optuna's ask-and-tell); the
trial trains in its slot of the one compiled program, with its values in the
slot's optimizer state. At each evaluation every running trial reports its
metric at its own age in steps (`trial.report`), then the pruner judges it
(`trial.should_prune`); a pruned trial, or one that ran its steps, is told to the
study, and its slot asks for the next trial and starts it fresh from
`config.seed` (the refill path of successive halving: nothing recompiles). The run
ends once the study holds `n_trials` trials and every slot has finished.

- The space: `config.sweep.study.space`, a distribution per sweepable name
  (`SPACE_KINDS`); anything that changes the program is refused (`NOT_SWEPT`).
- The sampler (`SAMPLERS`, seeded by `config.seed`) draws each trial from a
  generator seeded by `(seed, trial number)` (`TrialSeeded`), so a run resumed
  after a crash asks the trials the uninterrupted run asked.
- The pruners (`PRUNERS`): Optuna's median, successive-halving and Hyperband
  pruners, or `AshaPruner`, this project's successive halving
  (`config.sweep.halving`'s rungs) judged over the study's trials.
- The storage: an Optuna journal file (in the workdir by default: a file, no
  server, safe for several processes through its lock), or any Optuna database
  URL. Runs that name the same storage and study share it: each asks for
  trials until the study holds `n_trials`.
- Resuming: the study keeps, on each trial, which run asked it, into which slot
  and at which step (the user attribute `sweep`). A run restarted from its
  checkpoint replays its evaluations: a trial the study already holds as pruned
  or complete ends where it did, one that already reported at that step went on,
  and a slot refilled after the checkpoint takes the trial it was given then.

The space and its checks are in `trainer.sweep.study_space`; the seeded sampler, the
pruners and the storage in `trainer.sweep.study_optuna` (both re-exported here).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ml_collections

from trainer.sweep.members import StudySweep
from trainer.sweep.scheduler_base import Decision, Scheduler, _badness
from trainer.sweep.study_optuna import (  # noqa: F401 -- this module's names before the split
  JOURNAL,
  StudyError,
  asha_pruner,
  make_pruner,
  open_storage,
  open_study,
  storage_url,
  trial_seed,
  trial_seeded,
)
from trainer.sweep.study_space import (  # noqa: F401
  PRUNERS,
  SAMPLERS,
  SPACE_KINDS,
  check_config,
  check_space,
  distributions,
  space_of,
)

if TYPE_CHECKING:
  import optuna

# -- The scheduler ----------------------------------------------------------------------------

class StudyScheduler(Scheduler):
  """The sweep's scheduler when an Optuna study chooses: each slot holds one trial of the
  study at a time (see the module's docstring).

  Args:
    sweep: the `StudySweep` (the base values, the trials' labels and values).
    study: the opened study (`open_study`).
    run: what tags this run's trials in the study (its workdir, absolute).
    n_trials: the study's size, over every run that shares it.
    space: the search space, `config.sweep.study.space`'s entries.
  """

  name = "study"

  @property
  def rounds(self) -> int:
    return -(-self.n_trials // self.num_slots)

  def __init__(self, sweep: StudySweep, *, slots: int, budget: int, mode: str,
               study: optuna.Study, run: str, n_trials: int, space: Mapping[str, tuple]):
    super().__init__(sweep, slots=slots, budget=budget, mode=mode)
    self.study, self.run, self.n_trials = study, run, n_trials
    self.distributions = distributions(space)
    self.slots = [None] * slots
    self.started = False
    #: `budget -> pruner`: the configured pruner, made once the trials' length is known.
    self.make_pruner: Any = None

  def set_budget(self, budget: int) -> None:
    super().set_budget(budget)
    if self.make_pruner is not None:
      self.study.pruner = self.make_pruner(budget)

  # -- Trials in and out of the study --

  def _first_records(self) -> list[dict[str, Any]]:
    return []  # Asked when the run begins (`first_trials`).

  def _tag(self, slot: int, step: int) -> dict[str, Any]:
    return {"run": self.run, "slot": slot, "start": step}

  def _next_trial(self, slot: int, step: int) -> int | None:
    """The trial slot `slot` starts at `step`: the one this run was given there before a
    restart, else a new one asked from the study while it holds fewer than `n_trials`."""
    known = {r["trial"] for r in self.trials}
    tag = self._tag(slot, step)
    trials = self.study.get_trials(deepcopy=False)
    mine = [t for t in trials if t.user_attrs.get("sweep") == tag and t.number not in known]
    if mine:
      frozen = mine[0]
      params = frozen.params
      logging.info("Sweep study: slot %d takes back trial %d (asked before the restart)",
                   slot, frozen.number)
    elif len(trials) < self.n_trials:
      trial = self.study.ask(self.distributions)
      trial.set_user_attr("sweep", tag)
      frozen, params = trial, trial.params
    else:
      return None
    self.sweep.add(frozen.number, params)
    return frozen.number

  def first_trials(self, step: int) -> bool:
    """Asks the first trial of every slot (not on a resumed run, whose slots hold theirs);
    True when the slots' values changed."""
    if self.started:
      return False
    self.started = True
    self._refill(range(self.num_slots), step)
    return True

  def _report_all(self, step: int, values: Sequence[float]) -> list[tuple[int, dict, Any]]:
    """Each running slot's `(slot, record, frozen trial before this report)`, after
    reporting its value at its age (unless the study holds one there already)."""
    import optuna
    # Copies: the storage's own objects would take this call's reports.
    frozen = {t.number: t for t in self.study.get_trials(deepcopy=True)}
    running = []
    for slot, trial in enumerate(self.slots):
      record = self.current(slot)
      if trial is None or record is None or record["status"] != "running":
        continue
      before = frozen[trial]
      age, value = step - self.start[slot], float(values[slot])
      record["curve"].append([step, age, value])
      if (before.state == optuna.trial.TrialState.RUNNING
          and age not in before.intermediate_values and math.isfinite(value)):
        optuna.trial.Trial(self.study, before._trial_id).report(value, age)
      running.append((slot, record, before))
    return running

  def observe(self, step: int, values: Sequence[float]) -> Decision:
    return self.decide(step, [float(v) for v in values])

  # -- How a trial ended, kept in the study so that a restart replays it exactly --

  def _tell_end(self, before: Any, step: int, age: int, status: str, state: str, *,
                value: float | None = None, why: Mapping[str, Any] | None = None) -> None:
    """Tells the study that trial `before` ended at `age` (`status` in its record, `state`
    in the study, with `value` when it completed), keeping first on the trial where it
    ended and why (the user attribute `sweep_end`, which a restart replays); then ends its
    record."""
    import optuna
    ending = {"step": step, "age": age, "status": status, "state": state, "value": value,
              "why": dict(why or {})}
    optuna.trial.Trial(self.study, before._trial_id).set_user_attr("sweep_end", ending)
    self._tell(before.number, ending)

  def _tell(self, trial: int, ending: Mapping[str, Any]) -> None:
    import optuna
    if ending["state"] == "COMPLETE":
      self.study.tell(trial, ending["value"])
    else:
      self.study.tell(trial, state=optuna.trial.TrialState[ending["state"]])

  def _replayed_end(self, before: Any, age: int) -> dict[str, Any] | None:
    """How the trial `before` (as the study held it before this evaluation) ended at `age`
    before a restart, or None: it did not end there (it went on, or this is new)."""
    import optuna
    ending = before.user_attrs.get("sweep_end")
    if ending is not None:
      return dict(ending) if ending["age"] == age else None
    if before.state == optuna.trial.TrialState.RUNNING:
      return None
    # Told without a record of where (another version, or `finish`): its last report.
    last = max(before.intermediate_values, default=age)
    if age < last:
      return None
    status = {"PRUNED": "stopped", "COMPLETE": "completed"}.get(before.state.name, "failed")
    return {"age": age, "status": status, "state": before.state.name, "value": before.value,
            "why": {}}

  def _judged(self) -> int:
    """The last evaluation step whose judgements this run finished (-1: none)."""
    return int(self.study.user_attrs.get(f"sweep_judged {self.run}", -1))

  def decide(self, step: int, values: list[float]) -> Decision:
    import optuna
    state = optuna.trial.TrialState
    running = self._report_all(step, values)
    judged = self._judged()
    freed, completed = [], []
    for slot, record, before in running:
      age, trial = step - self.start[slot], record["trial"]
      ending = self._replayed_end(before, age)
      if ending is not None:  # Ended here before a restart: ends here again.
        if before.state == state.RUNNING:  # Killed between the record and the tell.
          self._tell(trial, ending)
        self._end(record, step, ending["status"], slot, **ending["why"])
      elif before.state != state.RUNNING:  # Ended later before a restart: it went on.
        continue
      elif age >= self.budget:
        self._tell_end(before, step, age, "completed", "COMPLETE", value=values[slot])
        self._end(record, step, "completed", slot)
      elif age in before.intermediate_values and step <= judged:  # Judged: it went on.
        continue
      elif not math.isfinite(values[slot]):
        why = {"why": "non-finite metric"}
        self._tell_end(before, step, age, "stopped", "FAIL", why=why)
        self._end(record, step, "stopped", slot, **why)
      elif optuna.trial.Trial(self.study, before._trial_id).should_prune():
        why = {"pruner": self.study.pruner.__class__.__name__, "age": age}
        self._tell_end(before, step, age, "stopped", "PRUNED", why=why)
        self._end(record, step, "stopped", slot, **why)
      else:
        continue
      if record["status"] == "completed":
        completed.append(slot)
      freed.append(slot)
    leaving = {slot: self.slots[slot] for slot in completed}
    refill, frozen = self._refill(freed, step)
    if step > judged:
      self.study.set_user_attr(f"sweep_judged {self.run}", step)
    best = self.study_best()
    export = next(((slot, t) for slot, t in leaving.items()
                   if slot in refill and best is not None and best.number == t), None)
    return Decision(step, refill=refill, values={s: self.values[s] for s in refill},
                    frozen=tuple(frozen), export=export,
                    finished=all(t is None for t in self.slots))

  def observe_only(self, step: int, values: Sequence[float]) -> None:
    """The run's last evaluation: trials that ran their steps complete; any other still
    running is told as failed by `finish` (the run ends before it could finish)."""
    import optuna
    running = self._report_all(step, values)
    for slot, record, before in running:
      age = step - self.start[slot]
      ending = self._replayed_end(before, age)
      if ending is not None:  # Ended here before a restart.
        if before.state == optuna.trial.TrialState.RUNNING:
          self._tell(record["trial"], ending)
        self._end(record, step, ending["status"], slot, **ending["why"])
      elif before.state == optuna.trial.TrialState.RUNNING and age >= self.budget:
        self._tell_end(before, step, age, "completed", "COMPLETE", value=float(values[slot]))
        self._end(record, step, "completed", slot)

  def study_best(self) -> Any:
    """The study's best complete trial (any run's), or None."""
    try:
      return self.study.best_trial
    except ValueError:  # None complete yet.
      return None

  def best_trial(self) -> dict[str, Any] | None:
    """This run's best completed trial."""
    done = [r for r in self.trials if r["status"] == "completed" and r["curve"]]
    if not done:
      return None
    return min(done, key=lambda r: (_badness(r["curve"][-1][2], self.mode), r["trial"]))

  def should_export(self, record: Mapping[str, Any]) -> bool:
    """Only the study's best trial is exported (by the run that trained it)."""
    best = self.study_best()
    return best is not None and best.number == record["trial"]

  def on_export(self, trial: int, directory: str) -> None:
    self.study.set_user_attr("sweep_best", {"trial": trial, "run": self.run,
                                            "checkpoint": os.path.abspath(directory)})

  def finish(self, step: int) -> None:
    """Fails this run's trials that are running in the study but in no slot (asked before
    a restart that then chose differently) or cut short by the run's end."""
    import optuna
    ours = {r["trial"] for r in self.trials if r["status"] in ("completed", "stopped")}
    for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
      tag = t.user_attrs.get("sweep") or {}
      if tag.get("run") == self.run and t.number not in ours:
        self.study.tell(t.number, state=optuna.trial.TrialState.FAIL)
        for record in self.trials:
          if record["trial"] == t.number and record["status"] == "running":
            self._end(record, step, "failed", record["slot"], why="the run ended first")

  def summary(self) -> dict[str, Any]:
    """What `sweep.json` records of the study."""
    best = self.study_best()
    counts: dict[str, int] = {}
    for t in self.study.get_trials(deepcopy=False):
      counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
    return {"name": self.study.study_name, "n_trials": self.n_trials, "states": counts,
            "sampler": type(self.study.sampler).__name__, "pruner":
            type(self.study.pruner).__name__,
            "best": None if best is None else {"trial": best.number, "value": best.value,
                                               "params": best.params}}

  def state_dict(self) -> dict[str, Any]:
    return {**super().state_dict(), "started": self.started,
            "asked": {str(k): v for k, v in self.sweep.asked.items()}}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    super().load_state_dict(state)
    self.started = bool(state["started"])
    for number, params in state["asked"].items():
      self.sweep.add(int(number), params)


def create(config: ml_collections.ConfigDict, sweep: StudySweep, *, slots: int,
           workdir: str | None) -> StudyScheduler:
  """The study's scheduler for a run in `workdir` (its budget set when the run begins).

  Raises:
    StudyError: the storage cannot be opened, or holds a study made for another run.
  """
  import jax
  if jax.process_count() > 1:
    raise StudyError(f"config.sweep.study under {jax.process_count()} processes: the study is "
                     f"shared between programs, not between the processes of one; start one "
                     f"run per host on the same storage instead (each its own workdir).")
  import optuna
  study = open_study(config, workdir, pruner=optuna.pruners.NopPruner())
  scheduler = StudyScheduler(sweep, slots=slots, budget=0, mode=config.sweep.mode,
                             study=study, run=os.path.abspath(workdir or "."),
                             n_trials=config.sweep.study.n_trials, space=space_of(config))
  scheduler.make_pruner = lambda budget: make_pruner(config, budget)
  return scheduler
