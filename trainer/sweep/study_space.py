"""An Optuna study's search space and settings, checked (`config.sweep.study`): the
distribution kinds, samplers and pruners a config may name, each distribution as Optuna's.
Read by `trainer.sweep.study`, which re-exports these names; nothing here opens a study.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import ml_collections

from trainer.sweep.members import NOT_SWEPT, SWEPT, check_member

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
