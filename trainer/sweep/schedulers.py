"""Sweeps that choose: which configuration trains in which slot, decided at each evaluation
(`config.sweep.scheduler`).

The ensemble's members are *slots*; a *trial* is one configuration of the
sweep (its hyperparameters and seed, `Sweep.members[i]`) for the time it holds
a slot. A scheduler sees each slot's eval metric at every evaluation and
returns a `Decision`: which slots start a new trial (fresh from its seed),
which copy another slot's state (population-based training), which
hyperparameters each slot trains with from now on, and which slots are
frozen. Decisions depend only on the metrics, the step and `config.seed`, so a
resumed run makes the same ones. `trainer.sweep.select` applies them to the
stacked state; nothing here imports jax.

- `Halving` (`scheduler='halving'`): asynchronous successive halving (ASHA,
  Li et al. 2018, as Ray Tune's `ASHAScheduler` stops trials). A trial that
  reaches a rung (an age in steps) continues only while its metric is in the
  top `1/reduction_factor` of every trial recorded at that rung so far; a
  stopped or completed trial's slot takes the next configuration not yet
  tried, or is frozen when none is left.
- `PopulationBased` (`scheduler='pbt'`): every `ready_steps`, the bottom
  `fraction` of the slots copy the state of slots drawn from the top
  `fraction` (exploit) and perturb or resample the copied hyperparameters
  (explore), as Jaderberg et al. 2017 and Ray Tune's `PopulationBasedTraining`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

from trainer.sweep.members import REFILLING, SWEPT, Sweep
from trainer.sweep.scheduler_base import Decision, Scheduler, _badness  # noqa: F401 -- re-exported

#: `config.sweep.scheduler` values: '' trains every member to the end (a grid).
SCHEDULERS = ("", "halving", "pbt")

#: Swept names that hold integers (a perturbed value is rounded).
_INTEGER = ("warmup_steps",)
#: Swept names whose values must stay below 1.
_BELOW_ONE = ("momentum", "b1", "ema_decay")


class Halving(Scheduler):
  """Asynchronous successive halving with slot reuse.

  Args:
    rungs: the ages (a trial's own steps) at which trials are compared, ascending,
      each below `budget`.
    reduction_factor: a trial continues past a rung while in the top
      `1/reduction_factor` of the trials recorded there (ties: the earlier trial).
  """

  name = "halving"

  @property
  def rounds(self) -> int:
    """Each slot frees at least once per budget, so the queue drains within
    `ceil(trials / slots) - 1` budgets and its last trials end one budget later."""
    return -(-len(self.sweep) // self.num_slots)

  def __init__(self, sweep: Sweep, *, slots: int, budget: int, mode: str,
               rungs: Sequence[int], reduction_factor: float):
    super().__init__(sweep, slots=slots, budget=budget, mode=mode)
    self.rungs, self.reduction_factor = tuple(int(r) for r in rungs), reduction_factor
    #: Derives the rungs from the budget once it is known (None: `rungs` as given).
    self.derive_rungs: Callable[[int], tuple[int, ...]] | None = None
    #: Next configuration not yet tried.
    self.next_trial = slots
    #: Per rung, `{trial: metric}` of every trial that reached it.
    self.recorded: list[dict[str, float]] = [{} for _ in self.rungs]
    #: `(trial, metric)` of the best completed trial exported so far.
    self.exported: tuple[int, float] | None = None

  def set_budget(self, budget: int) -> None:
    super().set_budget(budget)
    if self.derive_rungs is not None:
      self.rungs = self.derive_rungs(budget)
      self.recorded = [{} for _ in self.rungs] if not any(self.recorded) else self.recorded

  def decide(self, step: int, values: list[float]) -> Decision:
    freed: list[int] = []
    completed: list[int] = []
    arrivals: list[tuple[int, int]] = []
    for slot, trial in enumerate(self.slots):
      record = self.current(slot)
      if trial is None or record is None or record["status"] != "running":
        continue
      age = step - self.start[slot]
      if age >= self.budget:
        self._end(record, step, "completed", slot)
        completed.append(slot)
        freed.append(slot)
        continue
      # A rung is judged at the first evaluation at or after it (a trial that started at
      # the end of another's budget may not meet its rungs on an evaluation step).
      passed = [k for k, rung in enumerate(self.rungs)
                if rung <= age and str(trial) not in self.recorded[k]]
      for k in passed:
        self.recorded[k][str(trial)] = values[slot]
      if passed:
        arrivals.append((slot, passed[-1]))
    for slot, rung in arrivals:  # Every arrival of this step is recorded before any is cut.
      trial = self.slots[slot]
      ranked = sorted(self.recorded[rung].items(),
                      key=lambda kv: (_badness(kv[1], self.mode), int(kv[0])))
      keep = max(1, math.ceil(len(ranked) / self.reduction_factor))
      if str(trial) not in [t for t, _ in ranked[:keep]]:
        self._end(self.current(slot), step, "stopped", slot,
                  rung=self.rungs[rung], rank=[t for t, _ in ranked].index(str(trial)) + 1,
                  of=len(ranked))
        freed.append(slot)
    leaving = {slot: self.slots[slot] for slot in completed}
    refill, frozen = self._refill(freed, step)
    export = self._export_before_refill(
        {slot: trial for slot, trial in leaving.items() if slot in refill}, values)
    return Decision(step, refill=refill, values={s: self.values[s] for s in refill},
                    frozen=tuple(frozen), export=export,
                    finished=all(t is None for t in self.slots))

  def _next_trial(self, slot: int, step: int) -> int | None:
    """The next configuration not yet tried, in the sweep's order."""
    del slot, step
    if self.next_trial >= len(self.sweep):
      return None
    self.next_trial += 1
    return self.next_trial - 1

  def _export_before_refill(self, leaving: Mapping[int, int], values: list[float]
                            ) -> tuple[int, int] | None:
    """`(slot, trial)` of the best completed trial whose slot is refilled now, if it is
    the best completed one so far: it is exported before its state is replaced."""
    if not leaving:
      return None
    slot = min(leaving, key=lambda s: (_badness(values[s], self.mode), s))
    if self.exported is None or _badness(values[slot], self.mode) < _badness(
        self.exported[1], self.mode):
      self.exported = (leaving[slot], values[slot])
      return slot, leaving[slot]
    return None

  def state_dict(self) -> dict[str, Any]:
    return {**super().state_dict(), "next_trial": self.next_trial, "recorded": self.recorded,
            "exported": self.exported}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    super().load_state_dict(state)
    self.next_trial = int(state["next_trial"])
    self.recorded = [dict(r) for r in state["recorded"]]
    self.exported = tuple(state["exported"]) if state["exported"] is not None else None


class PopulationBased(Scheduler):
  """Population-based training: every `ready_steps`, exploit and explore.

  Args:
    ready_steps: how often slots are ranked and the bottom ones replaced.
    fraction: the share of slots in the top and in the bottom (at least one each).
    perturb: factors a copied value is multiplied by (one drawn per name).
    resample_probability: the chance a copied value is drawn afresh from its range instead.
    ranges: name -> `(low, high)`: where a value is resampled, and kept within.
    seed: with the step, seeds every draw (`config.seed`).
  """

  name = "pbt"

  def __init__(self, sweep: Sweep, *, slots: int, budget: int, mode: str, ready_steps: int,
               fraction: float, perturb: Sequence[float], resample_probability: float,
               ranges: Mapping[str, tuple[float, float]], seed: int):
    super().__init__(sweep, slots=slots, budget=budget, mode=mode)
    self.ready_steps, self.fraction = ready_steps, fraction
    self.perturb, self.resample_probability = tuple(perturb), resample_probability
    self.ranges, self.seed = {n: tuple(map(float, r)) for n, r in ranges.items()}, seed
    #: Who copied whom, when, with which values.
    self.lineage: list[dict[str, Any]] = []

  def decide(self, step: int, values: list[float]) -> Decision:
    if step % self.ready_steps or step >= self.budget:
      return Decision(step)
    order = sorted(range(self.num_slots), key=lambda s: (_badness(values[s], self.mode), s))
    k = max(1, int(self.num_slots * self.fraction))
    top, bottom = order[:k], sorted(order[-k:])
    rng = np.random.default_rng([self.seed, step])
    copy: dict[int, int] = {}
    for child in bottom:
      parent = top[int(rng.integers(len(top)))]
      new = self.explore(self.values[parent], rng)
      copy[child] = parent
      entry = {"step": step, "child": child, "parent": parent,
               "child_metric": values[child], "parent_metric": values[parent],
               "before": {n: self.values[child][n] for n in self.ranges},
               "after": {n: new[n] for n in self.ranges}}
      self.lineage.append(entry)
      self.events.append({"event": "copy", **entry})
      self.values[child] = new
      record = self.current(child)
      record["end"], record["status"] = step, "replaced"
      self.trials.append({**self._record(record["trial"], child, step),
                          "label": self.sweep.label(record["trial"]), "values": dict(new),
                          "parent": parent})
    return Decision(step, copy=copy, values={s: self.values[s] for s in copy})

  def explore(self, parent: Mapping[str, float], rng: np.random.Generator) -> dict[str, float]:
    """The parent's hyperparameters, each explored name perturbed or resampled."""
    new = dict(parent)
    for name in self.ranges:  # In SWEPT's order: the draws are the same on every run.
      low, high = self.ranges[name]
      if rng.random() < self.resample_probability:
        if low > 0 and high >= 10 * low:
          value = float(np.exp(rng.uniform(np.log(low), np.log(high))))
        else:
          value = float(rng.uniform(low, high))
      else:
        value = float(parent[name] * self.perturb[int(rng.integers(len(self.perturb)))])
      value = min(max(value, low), high)
      if name in _INTEGER:
        value = float(round(value))
      new[name] = value
    return new

  def state_dict(self) -> dict[str, Any]:
    return {**super().state_dict(), "lineage": self.lineage}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    super().load_state_dict(state)
    self.lineage = list(state["lineage"])


def program_steps(sweep: Sweep | None, strategy: Any, num_steps: int) -> int:
  """The run's length for trials of `num_steps` steps each: `num_steps`, or under
  successive halving with fewer slots than configurations the most it can take,
  `ceil(configurations / slots) * num_steps` (the run ends when every trial has stopped
  or completed, usually well before)."""
  if sweep is None or sweep.scheduler not in REFILLING:
    return num_steps
  return -(-len(sweep) // strategy.num_members) * num_steps


def halving_rungs(config: ml_collections.ConfigDict, budget: int) -> tuple[int, ...]:
  """`config.sweep.halving.rungs`, or `min_steps * reduction_factor**k` below `budget`."""
  h = config.sweep.halving
  if len(h.rungs):
    return tuple(int(r) for r in h.rungs)
  first = h.min_steps or config.eval_every_steps
  rungs, age = [], first
  while age < budget:
    rungs.append(int(age))
    age = int(round(age * h.reduction_factor))
  return tuple(rungs)


def pbt_ranges(config: ml_collections.ConfigDict, sweep: Sweep) -> dict[str, tuple[float, float]]:
  """The names PBT explores, in `SWEPT`'s order, each with its range: `config.sweep.pbt.ranges`
  where given, else the smallest and largest value the sweep starts with."""
  given = {n: tuple(config.sweep.pbt.ranges[n]) for n in config.sweep.pbt.ranges
           if len(config.sweep.pbt.ranges[n])}
  names = [n for n in SWEPT if n in sweep.varied or n in given]
  return {n: given.get(n, (float(sweep.column(n).min()), float(sweep.column(n).max())))
          for n in names}


def create(config: ml_collections.ConfigDict, sweep: Sweep, *, slots: int,
           budget: int) -> Scheduler:
  """The scheduler `config.sweep.scheduler` names, for `slots` members and trials of
  `budget` steps ('': the grid's, which records and decides nothing)."""
  s = config.sweep
  if not s.scheduler:
    return Scheduler(sweep, slots=slots, budget=budget, mode=s.mode)
  if s.scheduler == "halving":
    halving = Halving(sweep, slots=slots, budget=budget, mode=s.mode,
                      rungs=halving_rungs(config, budget),
                      reduction_factor=s.halving.reduction_factor)
    if not len(s.halving.rungs):  # Derived from the trials' length, once it is known.
      halving.derive_rungs = lambda length: halving_rungs(config, length)
    return halving
  return PopulationBased(sweep, slots=slots, budget=budget, mode=s.mode,
                         ready_steps=s.pbt.ready_steps or config.eval_every_steps,
                         fraction=s.pbt.fraction, perturb=tuple(s.pbt.perturb),
                         resample_probability=s.pbt.resample_probability,
                         ranges=pbt_ranges(config, sweep), seed=config.seed)


def check_config(config: ml_collections.ConfigDict, sweep: Sweep | None) -> None:
  """Raises unless `config.sweep.scheduler` and its fields can work with `sweep`.

  Raises:
    ValueError: naming the field, its value and what is accepted.
  """
  s = config.sweep
  if s.scheduler not in SCHEDULERS:
    raise ValueError(f"config.sweep.scheduler={s.scheduler!r} is not one of {SCHEDULERS} ('' "
                     f"trains every member to the end).")
  if not s.scheduler:
    return
  if sweep is None or len(sweep) < 2:
    raise ValueError(f"config.sweep.scheduler={s.scheduler!r} chooses between a sweep's "
                     f"configurations, but config.sweep describes "
                     f"{0 if sweep is None else len(sweep)}; set sweep.grid, sweep.points or "
                     f"sweep.seeds.")
  every = config.eval_every_steps
  if not isinstance(every, int) or every < 1:
    raise ValueError(f"config.eval_every_steps={every!r}: config.sweep.scheduler="
                     f"{s.scheduler!r} decides at evaluations, so it needs an integer >= 1.")
  if s.scheduler == "halving":
    h = s.halving
    if not isinstance(h.reduction_factor, (int, float)) or h.reduction_factor <= 1:
      raise ValueError(f"config.sweep.halving.reduction_factor={h.reduction_factor!r} must be "
                       f"> 1 (2 keeps the top half at each rung).")
    steps = [int(r) for r in h.rungs] or [h.min_steps or every]
    bad = [r for r in steps if r <= 0 or r % every]
    if bad or sorted(set(steps)) != steps:
      raise ValueError(f"config.sweep.halving rungs {tuple(steps)} must be increasing "
                       f"multiples of config.eval_every_steps={every} (a trial is compared "
                       f"at evaluations).")
  else:
    p = s.pbt
    if p.ready_steps and (p.ready_steps < 0 or p.ready_steps % every):
      raise ValueError(f"config.sweep.pbt.ready_steps={p.ready_steps!r} must be a multiple of "
                       f"config.eval_every_steps={every} (0: every evaluation).")
    if not 0 < p.fraction <= 0.5:
      raise ValueError(f"config.sweep.pbt.fraction={p.fraction!r} must be in (0, 0.5]: the "
                       f"share of members in the top and in the bottom.")
    if not len(p.perturb) or min(p.perturb) <= 0:
      raise ValueError(f"config.sweep.pbt.perturb={tuple(p.perturb)!r} must be positive "
                       f"factors, e.g. (0.8, 1.2).")
    if not 0 <= p.resample_probability <= 1:
      raise ValueError(f"config.sweep.pbt.resample_probability={p.resample_probability!r} "
                       f"must be in [0, 1].")
    unknown = sorted(n for n in p.ranges if len(p.ranges[n]) and n not in SWEPT)
    if unknown:
      raise ValueError(f"config.sweep.pbt.ranges names {unknown}; PBT explores the sweepable "
                       f"names {sorted(SWEPT)}.")
    ranges = pbt_ranges(config, sweep)
    if not ranges:
      raise ValueError("config.sweep.scheduler='pbt' explores the hyperparameters the sweep "
                       "varies or config.sweep.pbt.ranges names, and there are none: sweep "
                       "e.g. sweep.grid.learning_rate, or give sweep.pbt.ranges.learning_rate.")
    for name, (low, high) in ranges.items():
      if not low <= high or (name in _BELOW_ONE and high >= 1) or low < 0:
        raise ValueError(f"config.sweep.pbt.ranges.{name}=({low}, {high}) must be a range "
                         f"low <= high of valid values (>= 0; below 1 for "
                         f"{', '.join(_BELOW_ONE)}).")
      if name in ("learning_rate",) and low <= 0:
        raise ValueError(f"config.sweep.pbt.ranges.learning_rate=({low}, {high}) must be "
                         f"positive.")
