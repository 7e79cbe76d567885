"""Capabilities a strategy has beyond the core: mixins the rest of the code tests with
`isinstance`, never flags (Lightning Fabric's shape).

- `Ensemble`: the state holds several independently initialised models on a
  leading member axis; predictions average over members. A single-model
  strategy takes one member of a saved ensemble with `restore_member`.
- The process layout (`strategies.mesh`): `OneProcess`, or `GlobalMeshBatch`
  when the batch is one global array over the devices of every process.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from strategies.tree import first_along_leading_axis, keypath_str, merge_along_leading_axis

PyTree = Any


def member_rng(rng: jax.Array, index: int | jax.Array) -> jax.Array:
  """The RNG that ensemble member `index` is initialised from.

  Member i's RNG does not depend on the ensemble size, so member 3 of a
  4-member ensemble is the same model as member 3 of an 8-member one, and a
  single-device run started from `member_rng(rng, i)` reproduces member i.
  """
  return jax.random.fold_in(rng, index)


def sweep_size(config: Any) -> int:
  """How many members `config.sweep` describes (0: no sweep): the grid's product (or
  the points), times the seeds (`trainer.sweep.Sweep` lists them)."""
  s = config.sweep
  sizes = [len(v) for v in s.grid.values() if len(v)]
  points = len(s.points) or int(np.prod(sizes)) if (len(s.points) or sizes) else 0
  if not points and not len(s.seeds):
    return 0
  return max(points, 1) * max(len(s.seeds), 1)


def sweep_seeds(config: Any) -> list[int] | None:
  """Each sweep member's seed (members are points x seeds, seeds innermost), or None."""
  size = sweep_size(config)
  if not size:
    return None
  seeds = [int(x) for x in config.sweep.seeds] or [int(config.seed)]
  return [seeds[i % len(seeds)] for i in range(size)]


def ensemble_size(config: Any, default: int) -> int:
  """`config.ensemble_size`, else the sweep's member count, else `default`."""
  return config.ensemble_size or sweep_size(config) or default


class Ensemble(abc.ABC):
  """Several independently initialised models (members) on a leading axis of every state array.

  Member i starts from `member_rng(rng, i)`; every member sees the same batch.
  A strategy with this capability supplies `mean_over_members` and
  `member_index` for its step; the host views, the checkpoint layout and the
  per-member reports are the same for every ensemble strategy and live here.
  """

  #: How many members the state holds.
  num_members: int
  name: str
  #: Each member's own seed (a sweep's): member i then starts from `PRNGKey(seed_i)`,
  #: the single-model run with that seed. None: `member_rng(rng, i)`.
  member_seeds: list[int] | None = None

  @abc.abstractmethod
  def mean_over_members(self, tree: PyTree) -> PyTree:
    """Averages a pytree over ensemble members inside a step (member probabilities)."""

  @abc.abstractmethod
  def member_index(self) -> jax.Array:
    """Which member the step is running for."""

  def member_rngs(self, rng: jax.Array) -> jax.Array:
    """The init RNGs of all members, stacked."""
    if self.member_seeds is not None:
      return jax.numpy.stack([jax.random.PRNGKey(s) for s in self.member_seeds])
    return jax.vmap(lambda i: member_rng(rng, i))(jax.numpy.arange(self.num_members))

  def merge_device_axis(self, metrics: PyTree) -> PyTree:
    return merge_along_leading_axis(metrics)  # Merging member metrics averages them.

  def outputs_to_host(self, outputs: PyTree) -> PyTree:
    return first_along_leading_axis(outputs)  # Ensemble means: the same for every member.

  def checkpoint_layout(self) -> dict[str, Any]:
    return {"num_members": self.num_members, "strategy": self.name}

  def which_models(self, flags: np.ndarray) -> str:
    """Names the members whose per-member `flags` are False (for error messages)."""
    return f" (ensemble member(s) {np.flatnonzero(~np.asarray(flags, bool)).tolist()})"

  def describe(self) -> str:
    return f"{self.name}: {self.num_members} members"


def restore_member(read: Callable[[PyTree], PyTree], target: PyTree, *, num_saved: int,
                   member: int, held_once: Callable[[str], bool] = lambda path: False
                   ) -> PyTree:
  """Member `member` of a saved ensemble of `num_saved`, placed like `target` (one model).

  Args:
    read: restores the saved arrays into a tree of `ShapeDtypeStruct` leaves.
    target: a single-model strategy's `checkpoint_target`.
    held_once: `path -> whether the ensemble saved that leaf once` (a frozen part every
      member read, `trainer.run.shared`: no member axis).
  """
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  once = jax.tree_util.tree_map_with_path(lambda p, _: held_once(keypath_str(p)), target)
  stacked = jax.tree.map(
      lambda o, x: jax.ShapeDtypeStruct(((), (num_saved,))[not o] + tuple(x.shape), x.dtype,
                                        sharding=device), once, target)
  return jax.tree.map(lambda o, x, t: jax.device_put(x if o else x[member], t.sharding),
                      once, read(stacked), target)


def models_named(strategy: Any) -> Callable[[np.ndarray], str]:
  """`flags -> text` naming the models whose flags are False ("" for one model)."""
  return strategy.which_models if isinstance(strategy, Ensemble) else lambda flags: ""


__all__ = ["Ensemble", "member_rng", "models_named", "restore_member"]
