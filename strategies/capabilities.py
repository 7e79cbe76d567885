"""Capabilities a strategy has beyond the core: mixins the rest of the code tests with
`isinstance`, never flags (Lightning Fabric's shape).

- `Ensemble`: the state holds several independently initialised models on a
  leading member axis; predictions average over members.
- `GlobalMeshBatch` (`strategies.mesh`): the batch is one global array over the
  devices of every process, each process putting its own rows.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from strategies.tree import first_along_leading_axis, merge_along_leading_axis

PyTree = Any


def member_rng(rng: jax.Array, index: int | jax.Array) -> jax.Array:
  """The RNG that ensemble member `index` is initialised from.

  Member i's RNG does not depend on the ensemble size, so member 3 of a
  4-member ensemble is the same model as member 3 of an 8-member one, and a
  single-device run started from `member_rng(rng, i)` reproduces member i.
  """
  return jax.random.fold_in(rng, index)


class Ensemble:
  """Several independently initialised models (members) on a leading axis of every state array.

  Member i starts from `member_rng(rng, i)`; every member sees the same batch.
  A strategy with this capability supplies `mean_over_members` and
  `member_index` for its step; the host views, the checkpoint layout and the
  per-member reports are the same for every ensemble strategy and live here.
  """

  #: How many members the state holds.
  num_members: int
  name: str

  def member_rngs(self, rng: jax.Array) -> jax.Array:
    """The init RNGs of all members, stacked."""
    return jax.vmap(lambda i: member_rng(rng, i))(jax.numpy.arange(self.num_members))

  def merge_device_axis(self, metrics: PyTree) -> PyTree:
    return merge_along_leading_axis(metrics)  # Merging member metrics averages them.

  def outputs_to_host(self, outputs: PyTree) -> PyTree:
    return first_along_leading_axis(outputs)  # Ensemble means: the same for every member.

  def checkpoint_layout(self) -> dict[str, Any]:
    return {"num_members": self.num_members, "strategy": self.name}

  def member_view(self, canonical: PyTree, member: int) -> PyTree:
    """Member `member` of a tree in the checkpoint layout (host arrays, member axis first)."""
    return jax.tree.map(lambda x: np.asarray(x)[member], canonical)

  def which_models(self, flags: np.ndarray) -> str:
    """Names the members whose per-member `flags` are False (for error messages)."""
    return f" (ensemble member(s) {np.flatnonzero(~np.asarray(flags, bool)).tolist()})"

  def describe(self) -> str:
    return f"{self.name}: {self.num_members} members"


__all__ = ["Ensemble", "member_rng"]
