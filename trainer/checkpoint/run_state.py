"""Everything a run saves and resumes, as one object saved and restored in one call.

A `RunState` is the train state, its step, the train data iterator's position
and the loop actions' JSON states (and, at an evaluation, its results, which
rank the best checkpoints). `save_run` writes it through the strategy's
checkpoint layout; `restore_run` reads it back into any strategy that can
hold it, one member of an ensemble included.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
from flax import serialization

from strategies import Strategy
from strategies.capabilities import restore_member
from strategies.tree import keypath_str
from trainer.checkpoint.store import Checkpointer, CheckpointError
from trainer.data import positions

PyTree = Any


@dataclasses.dataclass(frozen=True)
class RunState:
  """A run at a step: what a checkpoint holds.

  Attributes:
    state: the placed train state.
    step: the number of updates done.
    data: the train data iterator's position after the batch of step
      `step - 1` (a checkpointable iterator's `get_state()`), or None.
    shape: the machine shape that saved it (`run_shape`); empty for checkpoints of
      earlier releases.
    actions: the loop actions' JSON state, by action name.
    metrics: the eval results at `step`, if an evaluation ran there.
  """

  state: Any
  step: int
  data: Any = None
  actions: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  metrics: Mapping[str, float] | None = None
  shape: Mapping[str, int] = dataclasses.field(default_factory=dict)


def run_shape(strategy: Strategy) -> dict[str, int]:
  """What a checkpoint records of the machine that saved it: processes, the strategy's
  devices and `data_shards`, the number of blocks the processes read of each batch
  (`Strategy.process_rows`), which a per-process data position depends on."""
  return {"processes": jax.process_count(), "devices": strategy.num_devices,
          "data_shards": strategy.process_rows()[1]}


def _models(num_members: int) -> str:
  return f"{num_members} models" if num_members else "a single model"


def save_run(checkpointer: Checkpointer, strategy: Strategy, run: RunState) -> None:
  """Starts an asynchronous save of `run` as checkpoint `run.step`. A data position held per
  process (`trainer.data.lm`'s lanes) is first gathered from every process (each process
  saves at the same step)."""
  data = run.data
  if positions.is_process_local(data):
    data = positions.gather_state(data)
  state = strategy.checkpoint_state(run.state)
  layout = strategy.checkpoint_layout()
  if layout.get("shared"):  # The leaves an ensemble holds once are saved once.
    layout["held_once"] = _held_once(state)
  checkpointer.save(run.step, state, {**layout, "shape": run_shape(strategy)},
                    metrics=run.metrics, action_states=run.actions, data_state=data)


def _held_once(tree: PyTree) -> list[str]:
  """The paths of a shared ensemble state's (or its target's) leaves held once."""
  from strategies.sharded_ensemble import held_once
  return sorted(keypath_str(p).removesuffix("/value")
                for p, x in jax.tree_util.tree_leaves_with_path(tree) if held_once(x))


def _check_held_once(layout: Mapping[str, Any], target: PyTree, where: str) -> None:
  """Both the checkpoint and this run hold frozen parts once: the same parts."""
  saved, ours = set(layout.get("held_once", ())), set(_held_once(target))
  if saved != ours:
    only = lambda paths: ", ".join(sorted(paths)[:3]) + (" ..." if len(paths) > 3 else "")  # noqa: E731
    raise CheckpointError(
        f"checkpoint {where} and this run hold different frozen parts once for all "
        f"members: {len(saved - ours)} leaves are held once there only "
        f"({only(saved - ours) or 'none'}), "
        f"{len(ours - saved)} here only ({only(ours - saved) or 'none'}). "
        f"config.strategy.share_frozen (and what it can share) must be as when it was "
        f"written, or restore one member.")


def restore_run(checkpointer: Checkpointer, strategy: Strategy, abstract_state: PyTree, *,
                step: int | None = None, member: int | None = None) -> RunState:
  """Restores a checkpoint written under any strategy into `strategy`.

  Args:
    abstract_state: the abstract state of one model (`jax.eval_shape` of init).
    step: which checkpoint; the latest complete one if None.
    member: with an ensemble checkpoint and a single-model strategy, the
      member to restore.

  Raises:
    CheckpointError: no checkpoint, an unreadable one, a different model, or
      a member layout this strategy cannot hold.
  """
  step = checkpointer.latest_step() if step is None else step
  if step is None:
    raise CheckpointError(f"no complete checkpoint in {checkpointer.directory}.")
  layout = checkpointer.layout(step)
  saved, where = layout["num_members"], checkpointer.step_dir(step)
  ours = strategy.checkpoint_layout()["num_members"]
  target = strategy.checkpoint_target(abstract_state)
  if member is not None and not (saved and not ours):
    raise CheckpointError(
        f"member={member} asks for one member of an ensemble, but checkpoint {where} holds "
        f"{_models(saved)} and strategy {strategy.name!r} holds {_models(ours)}: a member "
        f"is restored from an ensemble or sweep checkpoint into a single-model strategy. "
        f"Leave member out to restore {'the whole ensemble' if ours else 'the model'}.")
  if saved and not ours:
    if member is None or not 0 <= member < saved:
      raise CheckpointError(
          f"checkpoint {where} holds an ensemble of {saved} members and strategy "
          f"{strategy.name!r} holds one model; pass member=i with 0 <= i < {saved} (got "
          f"{member}) to restore one of them.")
    restored = _restore_member(checkpointer, step, target, num_saved=saved, member=member,
                               held_once=frozenset(layout.get("held_once", ())))
  elif saved and layout.get("shared", False) != strategy.checkpoint_layout().get("shared",
                                                                                False):
    held = "holds" if layout.get("shared") else "does not hold"
    raise CheckpointError(
        f"checkpoint {where} {held} its frozen parts once for all members, and this run "
        f"{'does' if not layout.get('shared') else 'does not'}: config.strategy.share_frozen "
        f"(and what it can share) must be as when it was written "
        f"({'auto' if layout.get('shared') else 'none'}), or restore one member.")
  elif saved != ours:
    raise CheckpointError(
        f"checkpoint {where} holds {_models(saved)} (written by {layout.get('strategy')!r}) "
        f"but strategy {strategy.name!r} holds {_models(ours)}; an ensemble restores into "
        f"an ensemble of the same size, or one member of it into a single-model strategy.")
  else:
    if saved and layout.get("shared"):
      _check_held_once(layout, target, where)
    restored = checkpointer.restore(step, target)
  # `restored` is a train state whose static fields (apply_fn, tx) are this trainer's.
  return RunState(strategy.from_checkpoint(restored), step, data=layout.get("data"),
                  actions=dict(layout.get("actions") or {}), shape=dict(layout.get("shape") or {}))


def _restore_member(checkpointer: Checkpointer, step: int, target: PyTree, *, num_saved: int,
                    member: int, held_once: frozenset[str] = frozenset()) -> PyTree:
  """Member `member` of the ensemble saved at `step`, in the layout of `target` (one model).

  A sweep's members keep their hyperparameters in their optimizer state
  (`optax.inject_hyperparams`); such a member's optimizer state is read in the
  saved layout and converted to `target`'s (`single_model_opt_state`), as the
  sweep's own export does. Its moments carry over; its hyperparameters are this
  strategy's trainer's. `held_once`: the paths the layout records as saved once for every
  member (`save_run`).
  """
  read = lambda t: checkpointer.restore(step, t)  # noqa: E731
  wanted = serialization.to_state_dict(target)
  # A frozen part the ensemble held once was saved without the member axis (`save_run`).
  once = lambda path: path.removesuffix("/value") in held_once  # noqa: E731
  saved_opt = checkpointer.saved_arrays(step).get("opt_state")
  if not (isinstance(saved_opt, Mapping) and "inner_state" in saved_opt
          and "inner_state" not in wanted["opt_state"]):
    return restore_member(read, target, num_saved=num_saved, member=member, held_once=once)
  from trainer.sweep.optimizer import single_model_opt_state
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  as_saved = {**wanted, "opt_state": jax.tree.map(
      lambda m: jax.ShapeDtypeStruct(tuple(m.shape[1:]), m.dtype, sharding=device), saved_opt)}
  one = restore_member(read, as_saved, num_saved=num_saved, member=member, held_once=once)
  try:
    opt_state = single_model_opt_state(one["opt_state"], wanted["opt_state"])
  except ValueError as e:
    raise CheckpointError(f"member {member} of checkpoint {checkpointer.step_dir(step)} "
                          f"cannot be restored with this trainer's optimizer: {e}") from e
  one["opt_state"] = jax.tree.map(lambda x, t: jax.device_put(x, t.sharding), opt_state,
                                  wanted["opt_state"])
  return serialization.from_state_dict(target, one)
