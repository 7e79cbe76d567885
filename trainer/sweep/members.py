"""A sweep's members: each one's hyperparameters and seed, from `config.sweep`.

This module needs no jax, so an entry point can name the sweepable fields
while it parses its flags (`trainer.config.parse_flags`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

import ml_collections
import numpy as np

#: Swept name -> the config field it replaces per member.
SWEPT = {"learning_rate": "learning_rate", "weight_decay": "weight_decay",
         "momentum": "momentum", "b1": "b1", "grad_clip_norm": "grad_clip_norm",
         "warmup_steps": "schedule.warmup_steps", "ema_decay": "ema_decay",
         "beta": "preference.beta"}
#: Swept names of a setup's own section, each held in the train state as an array when
#: swept (a preference loss's `beta`: `trainer.preference`; distillation's divergence's:
#: `trainer.distill`); a config without the section cannot sweep them. The name's field
#: is the first of its candidates the config holds.
SETUP_SWEPT = ("beta",)
SETUP_FIELDS = {"beta": ("preference.beta", "distill.beta")}

#: Why a name outside `SWEPT` cannot be swept, and what to do instead.
NOT_SWEPT = ("a sweep trains every member in one compiled program, so it varies the optimizer's "
             "settings (held in each member's optimizer state), a preference loss's beta (in "
             "its train state) and the seed, never what changes the program: a module "
             "hyperparameter (a dropout rate, a width, the number of layers, LoRA's rank: "
             "adapters of another shape are another program over another layout) is swept "
             "with one run per value (e.g. --config.model.<field>=...), each of which may "
             "sweep the optimizer's settings")


def _config_value(config: ml_collections.ConfigDict, field: str) -> Any:
  node = config
  for part in field.split("."):
    node = node[part]
  return node


def _has(config: ml_collections.ConfigDict, field: str) -> bool:
  node = config
  for part in field.split("."):
    if part not in node:
      return False
    node = node[part]
  return True


def field_of(config: ml_collections.ConfigDict, name: str) -> str:
  """The config field swept `name` replaces (a setup's: the section the config holds)."""
  for field in SETUP_FIELDS.get(name, ()):
    if _has(config, field):
      return field
  return SWEPT[name]


def config_values(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The config's value of each swept name its sections hold."""
  fields = {name: field_of(config, name) for name in SWEPT}
  return {name: _config_value(config, field) for name, field in fields.items()
          if _has(config, field)}


def check_setup_names(config: ml_collections.ConfigDict, names) -> None:
  """Raises for a swept name of a setup section (`SETUP_SWEPT`) the config lacks."""
  for name in names:
    if name in SETUP_SWEPT and not _has(config, field_of(config, name)):
      raise ValueError(f"config.sweep sweeps {name!r}, which is config.{SWEPT[name]}: only a "
                       f"config with that field (configs/preference.py, configs/distill.py) "
                       f"can sweep it.")


@dataclasses.dataclass(frozen=True)
class Sweep:
  """The members of a sweep: each one's hyperparameters (every swept name) and seed.

  Attributes:
    members: per member, `{name: value}` for every name in `SWEPT` plus `seed`.
    varied: the names whose values differ between members, in config order
      (`seed` last when there are several seeds): what labels a member.
  """

  members: tuple[Mapping[str, float], ...]
  varied: tuple[str, ...]
  #: `config.sweep.scheduler`: '' trains every member to the end; 'halving' and 'pbt'
  #: choose between them (`trainer.sweep.schedulers`).
  scheduler: str = ""

  def __len__(self) -> int:
    return len(self.members)

  def values(self, i: int) -> Mapping[str, float]:
    """Configuration i's hyperparameters and seed."""
    return self.members[i]

  def label(self, i: int) -> str:
    """`learning_rate=0.1,seed=1`: member i by the values that vary."""
    return ",".join(f"{name}={_fmt(self.members[i][name])}" for name in self.varied)

  def column(self, name: str) -> np.ndarray:
    """Every member's value of `name`."""
    return np.asarray([m[name] for m in self.members])

  @property
  def seeds(self) -> list[int]:
    """Each member's seed: member i starts from `PRNGKey(seeds[i])`."""
    return [int(m["seed"]) for m in self.members]

  def member_config(self, config: ml_collections.ConfigDict, i: int,
                    values: Mapping[str, float] | None = None) -> ml_collections.ConfigDict:
    """The single-model config of member i: its values (or `values`, a population-based
    member's after exploring) in place of the config's, no sweep."""
    values = self.members[i] if values is None else values
    out = ml_collections.ConfigDict(config.to_dict())
    for name in SWEPT:
      if name not in values:
        continue
      field = field_of(config, name)
      *parents, last = field.split(".")
      node = out
      for part in parents:
        node = node[part]
      node[last] = type(node[last])(values[name])
    out.seed = int(self.members[i]["seed"])
    out.sweep = ml_collections.ConfigDict(config.sweep.to_dict())
    for name in SWEPT:
      out.sweep.grid[name] = ()
    out.sweep.points, out.sweep.seeds, out.sweep.scheduler = (), (), ""
    out.sweep.lr_find = False
    for name in out.sweep.study.space:
      out.sweep.study.space[name] = ()
    return out

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> Sweep | None:
    """The sweep `config.sweep` describes, or None when it sweeps nothing.

    Raises:
      ValueError: a point names something that cannot be swept, both `grid`
        and `points` are given, or a value is out of range.
    """
    s = config.sweep
    if any(len(s.study.space[n]) for n in s.study.space):
      return StudySweep.from_study_config(config)
    grid = {name: tuple(s.grid[name]) for name in SWEPT if len(s.grid[name])}
    points = [dict(p) for p in s.points]
    seeds = tuple(int(x) for x in s.seeds) or (config.seed,)
    if grid and points:
      raise ValueError(f"config.sweep.grid sweeps {sorted(grid)} and config.sweep.points has "
                       f"{len(points)} points; give one of them.")
    for where, names in [("grid", set(s.grid)), *(("points", set(p)) for p in points)]:
      unknown = names - set(SWEPT)
      if unknown:
        raise ValueError(f"config.sweep.{where} has {sorted(unknown)}, which cannot be swept; "
                         f"the sweepable names are {sorted(SWEPT)}: {NOT_SWEPT}.")
    if s.mode not in ("min", "max"):
      raise ValueError(f"config.sweep.mode={s.mode!r} must be 'min' or 'max'.")
    if not grid and not points and len(seeds) == 1 and not len(s.seeds):
      return None
    check_setup_names(config, [*grid, *(n for p in points for n in p)])
    base = config_values(config)
    if grid:
      points = [dict(zip(grid, values, strict=True))
                for values in itertools.product(*grid.values())]
    points = points or [{}]
    members = tuple({**base, **p, "seed": seed} for p in points for seed in seeds)
    for m in members:
      check_member(m, distill=_has(config, "distill.beta"))
    if (grid.get("ema_decay") or any("ema_decay" in p for p in points)) and min(
        m["ema_decay"] for m in members) <= 0:
      raise ValueError("config.sweep sweeps ema_decay with a value of 0; every swept decay "
                       "must be in (0, 1), so that each member's single-model run keeps an "
                       "EMA too.")
    varied = tuple(n for n in SWEPT if n in base and len({m[n] for m in members}) > 1)
    if len(seeds) > 1:
      varied += ("seed",)
    return cls(members, varied, scheduler=s.scheduler)


@dataclasses.dataclass(frozen=True)
class StudySweep(Sweep):
  """The configurations an Optuna study gives (`trainer.sweep.study`): trial n's values
  are known once it is asked (`add`). `members` holds `n_trials` copies of the config's
  own values (what the slots hold before their first trial); every trial starts from
  `config.seed`.
  """

  #: Trial number -> its hyperparameters and seed, as they are asked.
  asked: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
  #: Name -> the values that bound its distribution (low and high, or the categories).
  bounds: Mapping[str, tuple[float, ...]] = dataclasses.field(default_factory=dict)

  @property
  def base(self) -> Mapping[str, float]:
    return self.members[0]

  def add(self, number: int, params: Mapping[str, Any]) -> None:
    """Records trial `number`'s values (the base with the study's `params`)."""
    row = dict(self.base)
    for name, value in params.items():
      row[name] = float(value)
    self.asked[int(number)] = row

  def values(self, i: int) -> Mapping[str, float]:
    return self.asked[i]

  def label(self, i: int) -> str:
    return f"trial={i}"

  def column(self, name: str) -> np.ndarray:
    """The values `name` can take: its bounds (or categories), else the config's value (what
    the optimizer must be able to hold: a clip, a decay, a momentum)."""
    return np.asarray(self.bounds.get(name, (self.base[name],)), dtype=float)

  def member_config(self, config: ml_collections.ConfigDict, i: int,
                    values: Mapping[str, float] | None = None) -> ml_collections.ConfigDict:
    return Sweep.member_config(self, config, 0, self.asked[i] if values is None else values)

  @classmethod
  def from_study_config(cls, config: ml_collections.ConfigDict) -> StudySweep:
    s = config.sweep
    check_setup_names(config, [n for n in SWEPT if len(s.study.space[n])])
    base = {**config_values(config),
            "seed": config.seed}
    n = max(int(s.study.n_trials), 1) if isinstance(s.study.n_trials, int) else 1
    varied = tuple(name for name in SWEPT if len(s.study.space[name]))
    bounds = {name: tuple(float(v) for v in tuple(s.study.space[name])[1:]) for name in varied}
    return cls((base,) * n, varied, scheduler="study", bounds=bounds)


#: Schedulers whose slots take configurations in turn (more configurations than slots).
REFILLING = ("halving", "study")


def strategy_for(config: ml_collections.ConfigDict, sweep: Sweep | None,
                 strategy: Any = None) -> Any:
  """The strategy `config.strategy.name` names (or `strategy`, built in code), checked
  against the run's processes and, under a sweep, fitted to its members (`fit_strategy`).

  Raises:
    ValueError: the strategy cannot run here, or cannot hold the sweep's members.
  """
  from strategies import check_processes, create_strategy
  if strategy is not None:
    check_processes(type(strategy))
  else:
    try:
      strategy = create_strategy(config)  # Checks the process count itself.
    except ValueError as e:
      if sweep is None or config.ensemble_size:
        raise
      raise ValueError(f"config.sweep describes {len(sweep)} members (the ensemble's size, "
                       f"since config.ensemble_size=0): {e}") from e
  if sweep is not None:
    fit_strategy(sweep, strategy)
  return strategy


def fit_strategy(sweep: Sweep, strategy: Any) -> None:
  """Checks that `strategy` is an ensemble of exactly the sweep's members, and gives a
  strategy built in code (whose members have no seeds yet) the sweep's seeds.

  Raises:
    ValueError: naming the member count, the strategy and what would fit.
  """
  from strategies import Ensemble
  if not isinstance(strategy, Ensemble):
    raise ValueError(
        f"config.sweep describes {len(sweep)} members, but strategy {strategy.name!r} trains "
        f"one model; sweeps train as ensembles: set config.strategy.name to "
        f"'sharded_ensemble' (any member count that divides over its 'ensemble' mesh axis) "
        f"or 'pmap_ensemble' (one member per local device).")
  if sweep.scheduler in REFILLING:  # Slots take the configurations in turn.
    if strategy.num_members > len(sweep):
      what = ("config.sweep.study.n_trials is" if sweep.scheduler == "study"
              else "config.sweep describes")
      raise ValueError(
          f"{what} {len(sweep)} configurations but the strategy "
          f"{strategy.name!r} holds {strategy.num_members} slots "
          f"(config.ensemble_size={strategy.num_members}); successive halving fills each "
          f"slot with a configuration (a study's trial): set config.ensemble_size to at most "
          f"{len(sweep)} "
          f"(0 takes the sweep's count).")
  elif strategy.num_members != len(sweep):
    raise ValueError(
        f"config.sweep describes {len(sweep)} members but the strategy {strategy.name!r} "
        f"holds {strategy.num_members} (config.ensemble_size={strategy.num_members}); set "
        f"config.ensemble_size=0 to take the sweep's count, or change the sweep"
        + ("" if sweep.scheduler else " (config.sweep.scheduler='halving' trains more "
           "configurations than members, refilling the slots of stopped ones)") + ".")
  if strategy.member_seeds is None:
    strategy.member_seeds = sweep.seeds
  # Under halving the slots start with the first configurations; the rest wait.
  strategy.member_seeds = list(strategy.member_seeds)[:strategy.num_members]


def _fmt(value: float) -> str:
  return f"{value:g}" if isinstance(value, float) else str(value)


def check_member(m: Mapping[str, float], *, distill: bool = False) -> None:
  """Raises unless each of `m`'s swept values is in its name's range (`distill`: beta is
  distillation's, in [0, 1])."""
  checks = {"learning_rate": lambda v: v > 0, "weight_decay": lambda v: v >= 0,
            "momentum": lambda v: 0 <= v < 1, "b1": lambda v: 0 <= v < 1,
            "grad_clip_norm": lambda v: v >= 0,
            "warmup_steps": lambda v: float(v).is_integer() and v >= 0,
            "ema_decay": lambda v: 0 <= v < 1,
            "beta": (lambda v: 0 <= v <= 1) if distill else (lambda v: v > 0)}
  for name, ok in checks.items():
    if name in m and not ok(m[name]):
      raise ValueError(f"config.sweep value {name}={m[name]!r} is out of range (learning_rate "
                       f"> 0; weight_decay, grad_clip_norm >= 0; momentum, b1, ema_decay in "
                       f"[0, 1); warmup_steps an integer >= 0; beta > 0, or in [0, 1] for "
                       f"distillation).")
