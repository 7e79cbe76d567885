"""A scheduler's decisions applied to an ensemble's stacked state, between two compiled calls.

`Selection` holds the scheduler (`trainer.sweep.schedulers`) and turns each
`Decision` into one update of the placed state, whatever the ensemble strategy:

- a refilled slot takes a new member state made from its configuration's seed
  (`States.init_members`: the state its single run starts from), with the
  run's step counter (the data and the other members go on);
- a copied slot (PBT's exploit) takes the parameters, model state, optimizer
  state and EMA of its parent slot, and keeps its own RNG;
- every slot then trains with the scheduler's hyperparameters for it, placed
  in the optimizer state (`place_rows`), and a frozen slot's `active` flag is
  0 (the recipe's `HoldInactive` keeps its state).

The state keeps its shapes, dtypes and placement, so the train step never
recompiles. The gather is one jitted program (cross-device copies included)
and costs a few of the state's bytes per slot changed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strategies.sharded_ensemble import held_once
from trainer.sweep.optimizer import place_rows
from trainer.sweep.scheduler_base import Decision, Scheduler

PyTree = Any


@functools.partial(jax.jit, donate_argnums=())
def _gather(state: PyTree, fresh: PyTree, src: jax.Array, take_fresh: jax.Array) -> PyTree:
  """Member i of the result: `fresh`'s where `take_fresh[i]`, else `state`'s member
  `src[i]`; the step counter stays `state`'s and the RNG the member's own (or fresh)."""
  def pick(x, y):
    if held_once(x):  # A frozen part every member reads (`trainer.run.shared`).
      return x
    mask = take_fresh.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(mask, y, x[src])

  new = jax.tree.map(pick, state, fresh)
  own = jax.tree.map(lambda x, y: jnp.where(
      take_fresh.reshape((-1,) + (1,) * (x.ndim - 1)), y, x), state.rng, fresh.rng)
  return new.replace(step=state.step, rng=own)


def _placed_like(tree: PyTree, like: PyTree) -> PyTree:
  return jax.tree.map(lambda x, y: jax.device_put(x, y.sharding), tree, like)


class Selection:
  """Applies a scheduler's decisions to the run's state.

  Args:
    scheduler: decides at each evaluation from each slot's metric.
    init_members: `seeds -> placed ensemble state` whose member i starts from
      `PRNGKey(seeds[i])` (`trainer.run.States.init_members`).
    export: `(state, slot, directory, step) -> None`: writes a slot as a single-model
      checkpoint (a completed trial about to leave its slot).
    workdir: where that export goes (`<workdir>/sweep_best`); None: nowhere.
  """

  def __init__(self, scheduler: Scheduler, *,
               init_members: Callable[[list[int]], PyTree],
               export: Callable[..., None] | None = None, workdir: str | None = None):
    self.scheduler, self.init_members = scheduler, init_members
    self.export, self.workdir = export, workdir

  def labels(self) -> list[str | None]:
    return self.scheduler.labels()

  def start(self, state: PyTree, step: int) -> PyTree:
    """The state with the slots' first trials' values, where the scheduler chooses them
    when the run begins (a study); else `state` itself."""
    s = self.scheduler
    if not s.first_trials(step):
      return state
    for event in (e for e in s.events if e.get("step") == step):
      logging.info("Sweep step %d: %s", step, _describe(event))
    return place_rows(state, s.values, active=[t is not None for t in s.slots])

  def choose(self, state: PyTree, step: int, values: Sequence[float], *,
             last: bool) -> tuple[PyTree, Decision]:
    """The state after the scheduler's decision at an evaluation of `step`."""
    s = self.scheduler
    if last:  # Nothing runs after it: record, and end the trials that ran their budget.
      s.observe_only(step, values)
      return state, Decision(step, finished=True)
    decision = s.observe(step, values)
    for event in (e for e in s.events if e.get("step") == step):
      logging.info("Sweep step %d: %s", step, _describe(event))
    if not decision.changes_state and not decision.values:
      return state, decision
    if decision.export is not None and self.export is not None and self.workdir:
      slot, trial = decision.export
      ended = next(r for r in reversed(s.trials) if r["slot"] == slot and r["trial"] == trial
                   and r["status"] == "completed")
      self.export(state, slot, f"{self.workdir}/sweep_best", step=ended["end"] - ended["start"],
                  trial=trial, values=ended["values"])
      s.on_export(trial, f"{self.workdir}/sweep_best")
    num = s.num_slots
    src = np.arange(num)
    for child, parent in decision.copy.items():
      src[child] = parent
    take_fresh = np.zeros(num, bool)
    fresh = state
    if decision.refill:
      other = s.seed_of(next(iter(decision.refill.values())))  # Unused: those keep theirs.
      seeds = [s.seed_of(decision.refill[i]) if i in decision.refill else other
               for i in range(num)]
      fresh = _placed_like(self.init_members(seeds), state)
      take_fresh[list(decision.refill)] = True
    if decision.refill or decision.copy:
      state = _placed_like(_gather(state, fresh, jnp.asarray(src), jnp.asarray(take_fresh)),
                           state)
    return place_rows(state, s.values, active=[t is not None for t in s.slots]), decision


def _describe(event: dict[str, Any]) -> str:
  kind = event["event"]
  if kind == "stopped":
    if "rank" in event:
      return (f"slot {event['slot']} stops {event['label']} (rank {event['rank']} of "
              f"{event['of']} at rung {event['rung']})")
    why = (f"pruned by {event['pruner']} at step {event['age']} of its own" if "pruner" in event
           else event.get("why", "ended before a restart"))
    return f"slot {event['slot']} stops {event['label']} ({why})"
  if kind == "completed":
    return f"slot {event['slot']}: {event['label']} completed its steps"
  if kind == "refill":
    return f"slot {event['slot']} starts {event['label']}"
  if kind == "failed":
    return f"slot {event['slot']}: {event['label']} failed"
  if kind == "freeze":
    return f"slot {event['slot']} frozen: no configuration left to try"
  return (f"slot {event['child']} copies slot {event['parent']} "
          f"({event['child_metric']:.4g} -> {event['parent_metric']:.4g}): {event['after']}")
