"""The data axis every step binds, and the process-layout capability: which rows of every
global batch this process feeds (`OneProcess`, or `GlobalMeshBatch` over several processes)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

PyTree = Any

#: The name of the data axis inside every step: a model written for Flax's
#: `axis_name` pattern (`nn.BatchNorm(axis_name="batch")`, `lax.pmean(x, "batch")`)
#: reduces over the global batch under every strategy (per member in ensembles).
BATCH_AXIS = "batch"


def bind_size_one_batch_axis(fn: Callable[[PyTree], Any], inputs: PyTree) -> Any:
  """`fn(inputs)` inside a size-1 `vmap` named `BATCH_AXIS` over the array leaves of `inputs`.

  Non-array leaves (flags, None) pass through unchanged; every output gets the
  size-1 axis and loses it again.
  """
  flat, treedef = jax.tree.flatten(inputs)
  is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in flat]
  arrays = [x[None] for x, a in zip(flat, is_array, strict=True) if a]

  def call(arrays):
    it = iter(arrays)
    return fn(jax.tree.unflatten(treedef, [next(it) if a else x
                                           for x, a in zip(flat, is_array, strict=True)]))

  out = jax.vmap(call, axis_name=BATCH_AXIS, axis_size=1)(arrays)
  return jax.tree.map(lambda x: x[0], out)


def process_rows_of(sharding: jax.sharding.Sharding, num_replicas: int) -> tuple[int, int]:
  """`Strategy.process_rows` for a batch laid out by `sharding` over `num_replicas` parts.

  Raises:
    ValueError: this process's devices hold rows that are not one consecutive
      block (the mesh interleaves the processes along the batch axis).
  """
  if jax.process_count() == 1:
    return 0, 1
  rows = set()
  for index in sharding.addressable_devices_indices_map((num_replicas,)).values():
    start, stop, _ = index[0].indices(num_replicas)
    rows.update(range(start, stop))
  lo, hi = min(rows), max(rows) + 1
  size = hi - lo
  if len(rows) != size or num_replicas % size or lo % size:
    raise ValueError(
        f"process {jax.process_index()} holds batch rows {sorted(rows)} of {num_replicas}: "
        f"not one block of consecutive rows. Order the mesh so that each process's devices "
        f"are adjacent along the batch axis (jax.make_mesh does).")
  return lo // size, num_replicas // size


class OneProcess:
  """Process layout of a strategy whose devices are one process's: it feeds every batch whole.

  Every strategy mixes in a process layout; the Trainer asks it which rows a
  process feeds (`process_slice`) and cuts global eval batches with `local_rows`.
  """

  #: Whether the strategy's devices may belong to several processes (`jax.distributed`).
  spans_processes = False

  def process_rows(self) -> tuple[int, int]:
    """`(index, count)`: this process feeds block `index` of `count` equal, consecutive
    blocks of every global batch (`(0, 1)`: the whole batch, as on one process)."""
    return 0, 1

  def process_slice(self, global_batch_size: int) -> slice:
    """The rows of a global batch of `global_batch_size` that this process feeds."""
    index, count = self.process_rows()
    size = global_batch_size // count
    return slice(index * size, (index + 1) * size)

  def local_rows(self, batch: PyTree) -> PyTree:
    """This process's rows of a global host batch (the batch itself on one process)."""
    if self.process_rows()[1] == 1:
      return batch
    rows = self.process_slice(int(np.shape(jax.tree.leaves(batch)[0])[0]))
    return jax.tree.map(lambda x: np.asarray(x)[rows], batch)


class GlobalMeshBatch(OneProcess):
  """Process layout of jit strategies whose batch is one global array laid out by
  `_batch_sharding` over devices of every process (`jax.distributed`).

  Each process puts its own rows; which rows those are depends only on the
  sharding, so it is worked out once, not per batch.
  """

  spans_processes = True
  _batch_sharding: jax.sharding.Sharding
  num_data_replicas: int

  @functools.cached_property
  def _process_rows(self) -> tuple[int, int]:
    return process_rows_of(self._batch_sharding, self.num_data_replicas)

  def process_rows(self) -> tuple[int, int]:
    return self._process_rows

  def put_batch(self, batch: PyTree) -> PyTree:
    count = self._process_rows[1]
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
        self._batch_sharding, x, (np.shape(x)[0] * count,) + np.shape(x)[1:]), batch)

  @property
  def _stacked_batch_sharding(self) -> NamedSharding:
    """Several steps' batches: a leading step axis, then each batch as `_batch_sharding`."""
    return NamedSharding(self._batch_sharding.mesh,
                         PartitionSpec(None, *self._batch_sharding.spec))

  @property
  def _replicated_sharding(self) -> NamedSharding:
    return NamedSharding(self._batch_sharding.mesh, PartitionSpec())

  def put_batches(self, batches: PyTree) -> PyTree:
    count, sharding = self._process_rows[1], self._stacked_batch_sharding
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
        sharding, x, np.shape(x)[:1] + (np.shape(x)[1] * count,) + np.shape(x)[2:]), batches)

  def put_replicated(self, tree: PyTree) -> PyTree:
    sharding = self._replicated_sharding  # Every process holds the whole arrays.
    return jax.tree.map(lambda x: jax.make_array_from_callback(
        np.shape(x), sharding, lambda index: np.asarray(x)[index]), tree)
