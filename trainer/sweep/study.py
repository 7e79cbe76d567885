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
"""

from __future__ import annotations

import json
import logging
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ml_collections
import numpy as np

from trainer.sweep.members import NOT_SWEPT, SWEPT, StudySweep, check_member
from trainer.sweep.schedulers import Decision, Scheduler, _badness, halving_rungs

if TYPE_CHECKING:
  import optuna

#: `config.sweep.study.space` kinds: `(kind, ...)`.
SPACE_KINDS = ("float", "log", "int", "categorical")
#: `config.sweep.study.sampler` -> the `optuna.samplers` class.
SAMPLERS = {"tpe": "TPESampler", "random": "RandomSampler", "cmaes": "CmaEsSampler",
            "gp": "GPSampler", "qmc": "QMCSampler"}
#: `config.sweep.study.pruner` values.
PRUNERS = ("median", "successive_halving", "hyperband", "halving", "none")
#: Swept names that hold integers.
_INTEGER = ("warmup_steps",)
#: The file a study lives in by default, in the workdir.
JOURNAL = "study.journal"


class StudyError(ValueError):
  """A study that cannot serve this run: its storage, or what it holds."""


def space_of(config: ml_collections.ConfigDict) -> dict[str, tuple]:
  """`config.sweep.study.space`'s non-empty entries, name -> `(kind, ...)`."""
  space = config.sweep.study.space
  return {name: tuple(space[name]) for name in space if len(space[name])}


def check_space(config: ml_collections.ConfigDict) -> dict[str, tuple]:
  """The space, checked: every name sweepable, every distribution well formed and within
  the values its name accepts.

  Raises:
    ValueError: naming the field, its value and what is accepted.
  """
  space = space_of(config)
  for name, entry in space.items():
    field = f"config.sweep.study.space.{name}={entry!r}"
    if name not in SWEPT:
      why = ("every trial starts from config.seed; run the study once per seed"
             if name == "seed" else NOT_SWEPT)
      raise ValueError(f"{field}: {name!r} cannot be swept; the names a study can vary are "
                       f"{sorted(SWEPT)}: {why}.")
    kind, *args = entry
    if kind not in SPACE_KINDS:
      raise ValueError(f"{field}: the kind {kind!r} is not one of {SPACE_KINDS} (e.g. "
                       f"('log', 1e-4, 0.1), ('float', 0.0, 0.99), ('int', 0, 500), "
                       f"('categorical', 0.9, 0.99)).")
    if kind == "categorical":
      if not args or not all(isinstance(a, (int, float)) for a in args):
        raise ValueError(f"{field}: a categorical distribution is ('categorical', value, "
                         f"...) with at least one number.")
      values = args
    else:
      if len(args) != 2 or not all(isinstance(a, (int, float)) for a in args):
        raise ValueError(f"{field}: a {kind!r} distribution is ({kind!r}, low, high).")
      low, high = args
      if low > high:
        raise ValueError(f"{field}: low {low} is above high {high}.")
      if kind == "log" and low <= 0:
        raise ValueError(f"{field}: a log-uniform range must be above 0 (its low is {low}); "
                         f"use ('float', {low}, {high}) to include it.")
      if kind == "int" and not (float(low).is_integer() and float(high).is_integer()):
        raise ValueError(f"{field}: an 'int' distribution's low and high are integers.")
      if name in _INTEGER and kind != "int" and kind != "categorical":
        raise ValueError(f"{field}: {name} holds whole steps; use ('int', low, high).")
      values = (low, high)
    for value in values:
      try:
        check_member({name: value})
      except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
  return space


def distributions(space: Mapping[str, tuple]) -> dict[str, optuna.distributions.BaseDistribution]:
  """Optuna's distribution for each name of the space."""
  from optuna import distributions as d
  out = {}
  for name, (kind, *args) in space.items():
    if kind == "categorical":
      out[name] = d.CategoricalDistribution(tuple(args))
    elif kind == "int":
      out[name] = d.IntDistribution(int(args[0]), int(args[1]))
    else:
      out[name] = d.FloatDistribution(float(args[0]), float(args[1]), log=kind == "log")
  return out


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises unless `config.sweep.study` can run (no storage is opened here).

  Raises:
    ValueError: naming the field, its value and what is accepted.
  """
  s = config.sweep
  space = check_space(config)
  if not space:
    return
  study = s.study
  given = [f"sweep.{name}" for name in ("points", "seeds") if len(s[name])] + [
      f"sweep.grid.{n}" for n in s.grid if len(s.grid[n])]
  given += [f"sweep.scheduler={s.scheduler!r}"] if s.scheduler else []
  given += ["sweep.lr_find"] if s.lr_find else []
  if given:
    raise ValueError(f"config.sweep.study.space makes an Optuna study the sweep's source of "
                     f"configurations, so it cannot be combined with {given}; the study's "
                     f"pruner (config.sweep.study.pruner, 'halving' for this project's "
                     f"successive halving) stops trials.")
  if not isinstance(study.n_trials, int) or study.n_trials < 1:
    raise ValueError(f"config.sweep.study.n_trials={study.n_trials!r} must be an integer >= 1.")
  if study.sampler not in SAMPLERS:
    raise ValueError(f"config.sweep.study.sampler={study.sampler!r} is not a sampler Optuna "
                     f"has; one of {sorted(SAMPLERS)} ({', '.join(SAMPLERS.values())}).")
  if study.pruner not in PRUNERS:
    raise ValueError(f"config.sweep.study.pruner={study.pruner!r} is not a pruner Optuna has "
                     f"here; one of {PRUNERS} (halving: config.sweep.halving's rungs).")
  if not isinstance(study.startup_trials, int) or study.startup_trials < 0:
    raise ValueError(f"config.sweep.study.startup_trials={study.startup_trials!r} must be an "
                     f"integer >= 0.")
  if not study.name:
    raise ValueError("config.sweep.study.name='' must name the study.")
  every = config.eval_every_steps
  if not isinstance(every, int) or every < 1:
    raise ValueError(f"config.eval_every_steps={every!r}: a study's trials report at "
                     f"evaluations, so it needs an integer >= 1.")
  if study.pruner in ("successive_halving", "hyperband") and not float(
      s.halving.reduction_factor).is_integer():
    raise ValueError(f"config.sweep.halving.reduction_factor={s.halving.reduction_factor!r}: "
                     f"Optuna's {study.pruner} pruner takes an integer factor.")


# -- The sampler's randomness, per trial ----------------------------------------------------

def trial_seed(seed: int, number: int) -> int:
  """The seed of trial `number`'s draws: from the run's seed and the number only."""
  return int(np.random.SeedSequence([int(seed), int(number)]).generate_state(1)[0])


def _sampler_class(name: str) -> type:
  import optuna
  return getattr(optuna.samplers, SAMPLERS[name])


def _make_sampler(name: str, seed: int) -> optuna.samplers.BaseSampler:
  cls = _sampler_class(name)
  with warnings.catch_warnings():  # constant_liar is marked experimental.
    warnings.simplefilter("ignore", category=UserWarning)
    if name == "tpe":  # Concurrent trials: the running ones count as (bad) observations.
      return cls(seed=seed, constant_liar=True)
    return cls(seed=seed)


def trial_seeded(name: str, seed: int) -> optuna.samplers.BaseSampler:
  """`SAMPLERS[name]` whose draws for trial n come from a generator seeded by
  `trial_seed(seed, n)`: a sampler made for that trial alone, whatever this process
  asked before (a restarted run, or another run on the study, asks the same)."""
  import optuna

  class TrialSeeded(optuna.samplers.BaseSampler):
    """Delegates each trial to a sampler seeded for its number."""

    def __init__(self):
      self._for: dict[int, optuna.samplers.BaseSampler] = {}

    def _inner(self, trial: Any) -> optuna.samplers.BaseSampler:
      if trial.number not in self._for:
        self._for[trial.number] = _make_sampler(name, trial_seed(seed, trial.number))
      return self._for[trial.number]

    def infer_relative_search_space(self, study, trial):
      return self._inner(trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
      return self._inner(trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
      return self._inner(trial).sample_independent(study, trial, param_name,
                                                   param_distribution)

    def before_trial(self, study, trial):
      self._inner(trial).before_trial(study, trial)

    def after_trial(self, study, trial, state, values):
      inner = self._for.pop(trial.number, None) or _make_sampler(name, 0)
      inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:  # The seed is the trial's: nothing to reseed.
      pass

  return TrialSeeded()


# -- This project's successive halving as an Optuna pruner ----------------------------------

def asha_pruner(rungs: Sequence[int], reduction_factor: float, maximize: bool
                ) -> optuna.pruners.BasePruner:
  """Asynchronous successive halving over the study's trials (`Halving`'s rule): a trial
  that reaches a rung (its own steps) goes on only while its value there (its first report
  at or after the rung) is in the top `1/reduction_factor` of every trial that has reached
  it, ties to the earlier trial."""
  import optuna

  def at(trial: Any, rung: int) -> float | None:
    steps = [s for s in trial.intermediate_values if s >= rung]
    return trial.intermediate_values[min(steps)] if steps else None

  class AshaPruner(optuna.pruners.BasePruner):
    """This project's successive halving (`config.sweep.study.pruner='halving'`)."""

    def prune(self, study, trial) -> bool:
      step = trial.last_step
      if step is None:
        return False
      before = max((s for s in trial.intermediate_values if s < step), default=-1)
      passed = [r for r in rungs if before < r <= step]
      if not passed:
        return False
      rung = passed[-1]
      ranked = []
      for other in study.get_trials(deepcopy=False):
        value = at(other, rung)
        if value is not None:
          ranked.append((_badness(value, "max" if maximize else "min"), other.number))
      ranked.sort()
      keep = max(1, math.ceil(len(ranked) / reduction_factor))
      return trial.number not in [n for _, n in ranked[:keep]]

  return AshaPruner()


def make_pruner(config: ml_collections.ConfigDict, budget: int) -> optuna.pruners.BasePruner:
  """The pruner `config.sweep.study.pruner` names, for trials of `budget` steps: its first
  rung `sweep.halving.min_steps` (0: `eval_every_steps`), its factor
  `sweep.halving.reduction_factor`."""
  import optuna
  s = config.sweep
  name, first = s.study.pruner, s.halving.min_steps or config.eval_every_steps
  if name == "median":
    return optuna.pruners.MedianPruner(n_startup_trials=s.study.startup_trials,
                                       n_warmup_steps=first)
  if name == "successive_halving":
    return optuna.pruners.SuccessiveHalvingPruner(
        min_resource=first, reduction_factor=int(s.halving.reduction_factor))
  if name == "hyperband":
    return optuna.pruners.HyperbandPruner(min_resource=first, max_resource=max(budget, first),
                                          reduction_factor=int(s.halving.reduction_factor))
  if name == "halving":
    return asha_pruner(halving_rungs(config, budget), s.halving.reduction_factor,
                       s.mode == "max")
  return optuna.pruners.NopPruner()


# -- The storage ----------------------------------------------------------------------------

def storage_url(config: ml_collections.ConfigDict, workdir: str | None) -> str:
  """Where the study lives: `config.sweep.study.storage`, or the journal file in `workdir`."""
  given = config.sweep.study.storage
  if given:
    return given
  if not workdir:
    raise StudyError("config.sweep.study.storage='' keeps the study in the workdir "
                     f"(<workdir>/{JOURNAL}), and this run has none: pass fit(workdir=...) or "
                     "name a storage.")
  return os.path.join(workdir, JOURNAL)


def open_storage(url: str) -> Any:
  """The Optuna storage at `url`: a database URL (`dialect://...`) or a journal file path.

  Raises:
    StudyError: naming the URL, with the database's own error kept as the cause.
  """
  import optuna
  try:
    if "://" in url:
      return optuna.storages.RDBStorage(url)
    directory = os.path.dirname(os.path.abspath(url))
    os.makedirs(directory, exist_ok=True)
    backend = optuna.storages.journal.JournalFileBackend(url)
    return optuna.storages.JournalStorage(backend)
  except Exception as e:  # noqa: BLE001 -- any driver's error, named and kept.
    raise StudyError(f"config.sweep.study.storage={url!r} cannot be opened: "
                     f"{type(e).__name__}: {e}") from e


def _space_record(space: Mapping[str, tuple]) -> dict[str, list]:
  return {name: list(entry) for name, entry in sorted(space.items())}


def open_study(config: ml_collections.ConfigDict, workdir: str | None, *,
               pruner: optuna.pruners.BasePruner) -> optuna.Study:
  """The study `config.sweep.study` names, created or loaded, with its seeded sampler.

  Raises:
    StudyError: the storage cannot be opened, or the study there was made for another
      direction or search space.
  """
  import optuna
  s = config.sweep
  url = storage_url(config, workdir)
  storage = open_storage(url)
  direction = "maximize" if s.mode == "max" else "minimize"
  space = _space_record(space_of(config))
  try:
    study = optuna.create_study(storage=storage, study_name=s.study.name, direction=direction,
                                sampler=trial_seeded(s.study.sampler, config.seed),
                                pruner=pruner, load_if_exists=True)
  except Exception as e:  # noqa: BLE001
    raise StudyError(f"config.sweep.study.storage={url!r}: study {s.study.name!r} cannot be "
                     f"created or loaded: {type(e).__name__}: {e}") from e
  saved = study.user_attrs.get("sweep_space")
  if study.direction.name.lower() != direction:
    raise StudyError(f"study {s.study.name!r} in {url!r} was created to "
                     f"{study.direction.name.lower()}, but config.sweep.mode={s.mode!r} "
                     f"asks to {direction}; name another study (config.sweep.study.name) or "
                     f"set the mode it was made with.")
  if saved is None:
    if study.trials:
      raise StudyError(f"study {s.study.name!r} in {url!r} holds {len(study.trials)} trials "
                       f"that no sweep made (no 'sweep_space' attribute); name another study.")
    study.set_user_attr("sweep_space", space)
    study.set_user_attr("sweep_metric", s.metric)
  elif json.dumps(saved, sort_keys=True) != json.dumps(space, sort_keys=True):
    raise StudyError(f"study {s.study.name!r} in {url!r} was created with the search space "
                     f"{saved}, but config.sweep.study.space is {space}; a resumed or shared "
                     f"study keeps its space: name another study (config.sweep.study.name).")
  return study


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
