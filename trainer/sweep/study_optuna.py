"""What a sweep's study takes from Optuna: a sampler seeded per trial (`trial_seeded`),
the pruner the config names (`make_pruner`, with this project's successive halving as an
Optuna pruner, `asha_pruner`) and the study in its storage (`open_study`: a journal file
in the workdir by default, or any Optuna database URL). `trainer.sweep.study` re-exports
these names and schedules the trials.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ml_collections
import numpy as np

from trainer.sweep.schedulers import _badness, halving_rungs
from trainer.sweep.study_space import SAMPLERS, space_of

if TYPE_CHECKING:
  import optuna

#: The file a study lives in by default, in the workdir.
JOURNAL = "study.journal"


class StudyError(ValueError):
  """A study that cannot serve this run: its storage, or what it holds."""


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
