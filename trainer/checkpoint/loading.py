"""Placing what a `config.init_from` plan reads: each device's part of each loaded array
read from its source on its own, into a state in the strategy's layout."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from strategies.tree import to_host
from trainer.checkpoint.source import Flat
from trainer.checkpoint.source import leaf_name as _name

if TYPE_CHECKING:
  from trainer.checkpoint import init_from

PyTree = Any


def _reader(plan_: init_from.Plan, collection: str, path: str, *, num_members: int,
            whole: Flat | None) -> Callable[[tuple], np.ndarray]:
  """`index of the new array -> its values`: the source's slice of the old array that
  `path` comes from, with the member axis picked or broadcast as the plan says.

  Args:
    whole: a source without slices, read whole (None: the source reads slices).
  """
  source, old = plan_.source, plan_.mapped[collection][path]

  def read_source(index):
    if whole is None:
      return source.read_slice(collection, old, index)
    return whole[collection][old][tuple(index)]

  def read(index):  # `index` in the source's axes (its member axis included).
    if path not in plan_.padded.get(collection, {}):
      return read_source(index)
    axis, rows, new_rows = plan_.padded[collection][path]
    axis += 1 if source.num_members else 0
    index = list(index) + [slice(None)] * (axis + 1 - len(index))
    start, stop, _ = index[axis].indices(new_rows)
    index[axis] = slice(min(start, rows), min(stop, rows))
    x = read_source(tuple(index))
    width = [(0, 0)] * x.ndim
    width[axis] = (0, stop - start - x.shape[axis])  # The padded rows: zeros.
    return np.pad(x, width)

  def sliced(index):
    index = tuple(index)
    if plan_.member is not None:  # Member m of a saved ensemble into each model.
      m = plan_.member
      if num_members:
        x = read((slice(m, m + 1),) + index[1:])
        return np.broadcast_to(x, (len(range(*index[0].indices(num_members))),) + x.shape[1:])
      return read((slice(m, m + 1),) + index)[0]
    if num_members and not source.num_members:  # One model starts every member.
      x = read(index[1:])
      return np.broadcast_to(x[None], (len(range(*index[0].indices(num_members))),) + x.shape)
    return read(index)

  return sliced


def _whole(plan_: init_from.Plan) -> Flat | None:
  """A source that cannot read slices, read whole (None: it reads slices)."""
  if plan_.source.read_slice is not None:
    return None
  return plan_.source.read({c: sorted(set(m.values())) for c, m in plan_.mapped.items() if m})


def placed(plan_: init_from.Plan, collection: str, tree: PyTree, targets: PyTree, *,
           num_members: int, whole: Flat | None | bool = False,
           held_once: Callable[[str], bool] = lambda name: False) -> PyTree:
  """`tree` (placed arrays of `collection`) with the variables `plan_` maps read from its
  source, each device's part on its own (a quantized weight from the blocks that cover
  it); the others keep their values. `targets`: the arrays' checkpoint targets; `whole`:
  the source read whole (`False`: read here where it cannot read slices); `held_once`:
  the variables an ensemble holds once (no member axis, `trainer.run.shared`)."""
  from trainer.step.quantized_base import is_quantized, quantized_from

  if whole is False:
    whole = _whole(plan_)

  def leaf(path, x, t):
    name = _name(path)
    if is_quantized(x):  # Quantized here, a shard's whole blocks at a time.
      if name not in plan_.mapped.get(collection, {}):
        return jax.tree.map(lambda y, u: leaf(path, y, u), x, t)
      read = _reader(plan_, collection, name, whole=whole,
                     num_members=0 if held_once(name) else num_members)
      return quantized_from(read, x, t)
    if name in plan_.mapped.get(collection, {}):
      read = _reader(plan_, collection, name, whole=whole,
                     num_members=0 if held_once(name) else num_members)
      return jax.make_array_from_callback(
          t.shape, t.sharding, lambda index: np.asarray(read(index), dtype=t.dtype))
    host = to_host(x)  # A fresh variable keeps its initial value.
    return jax.make_array_from_callback(t.shape, t.sharding, lambda index: host[index])
  return jax.tree_util.tree_map_with_path(leaf, tree, targets, is_leaf=is_quantized)


def start_from(plan_: init_from.Plan, strategy: Any, state: PyTree, abstract_state: PyTree,
               rebuild: Callable[[PyTree, PyTree, jax.Array], PyTree], *,
               linen: bool) -> PyTree:
  """The placed state of a fresh run whose variables `plan_` partly loads.

  Each loaded array is made on the devices from the source's slices, one device's part
  at a time (`jax.make_array_from_callback`), so a source that reads slices (an HF
  checkpoint) never puts a whole sharded array on the host; the new optimizer and recipe
  state are computed on the devices, in the strategy's layout.

  Args:
    state: the fresh placed state (its other variables, its RNG).
    abstract_state: one model's abstract state (the checkpoint target's shapes).
    rebuild: `(params, model_state, rng) -> a fresh state of one model` (the optimizer's
      and the recipe's state start again from the loaded values).
  """
  from trainer.run import shared
  num_members = strategy.checkpoint_layout()["num_members"]
  target = strategy.checkpoint_target(abstract_state)
  current = strategy.checkpoint_state(state)
  place = functools.partial(placed, plan_, num_members=num_members, whole=_whole(plan_))
  params = place("params", current.params, target.params,
                 held_once=shared.held_once(strategy, "params"))
  if linen:
    model_state = {c: place(c, tree, target.model_state[c])
                   for c, tree in dict(current.model_state or {}).items()}
  else:
    model_state = place("model_state", current.model_state, target.model_state)
  rng = place("rng", current.rng, target.rng)
  fresh = shared.per_member(strategy, rebuild, abstract_state) if num_members else rebuild
  shardings = jax.tree.map(lambda t: t.sharding, target)
  rebuilt = jax.jit(fresh, out_shardings=shardings)(params, model_state, rng)
  logging.info("init_from: %s", plan_.describe())
  return strategy.from_checkpoint(rebuilt)
