"""The Strategy interface: how a run's state and batches are laid out on devices.

A `Trainer` writes its step functions once, in single-replica terms. A strategy
answers every question about devices: how state is created and placed, how a
host batch becomes device arrays, how a step is compiled, which collectives the
step needs, and how device results come back to the host in a layout that does
not depend on the strategy. The collectives default to identities, which is
exactly what the single-device reference needs.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

#: The name of the data axis inside every step: a model written for Flax's
#: `axis_name` pattern (`nn.BatchNorm(axis_name="batch")`, `lax.pmean(x, "batch")`)
#: reduces over the global batch under every strategy (per member in ensembles).
BATCH_AXIS = "batch"

InitFn = Callable[[jax.Array], PyTree]
StepFn = Callable[..., Any]


def member_rng(rng: jax.Array, index: int | jax.Array) -> jax.Array:
  """The RNG that ensemble member `index` is initialised from.

  Member i's RNG does not depend on the ensemble size, so member 3 of a
  4-member ensemble is the same model as member 3 of an 8-member one, and a
  single-device run started from `member_rng(rng, i)` reproduces member i.
  """
  return jax.random.fold_in(rng, index)


class Strategy(abc.ABC):
  """Places state and batches on devices and compiles step functions.

  Subclasses implement the abstract layout methods; the in-step collectives
  (`mean_over_data`, `mean_over_members`, `replica_rng`) are identities here
  and are overridden only by strategies whose step runs per device.
  """

  #: The name the strategy is registered under (`config.strategy.name`).
  name: str = ""

  #: How many independently initialised models the state holds.
  num_members: int = 1

  #: Whether every state array carries a leading member axis (ensembles).
  is_ensemble: bool = False

  #: Whether the strategy's devices may belong to several processes (`jax.distributed`).
  spans_processes: bool = False

  @property
  @abc.abstractmethod
  def num_data_replicas(self) -> int:
    """How many parts the global batch is split into."""

  def check_batch_size(self, global_batch_size: int) -> None:
    """Raises ValueError unless the global batch splits evenly over the data replicas."""
    replicas = self.num_data_replicas
    if global_batch_size <= 0 or global_batch_size % replicas:
      raise ValueError(
          f"config.batch_size={global_batch_size} must be a positive multiple of the "
          f"{replicas} data replicas of strategy {self.name!r}; "
          f"try {max(replicas, global_batch_size - global_batch_size % replicas)}.")

  @classmethod
  def check_processes(cls) -> None:
    """Raises ValueError on a multi-process run if the strategy sees one process's devices."""
    if jax.process_count() > 1 and not cls.spans_processes:
      from strategies.registry import multi_process_strategies
      raise ValueError(
          f"config.strategy.name={cls.name!r} places everything on the devices of one "
          f"process, but this run has {jax.process_count()} processes (jax.distributed); "
          f"use one of {multi_process_strategies()}, whose mesh spans all processes.")

  # -- Process layout ----------------------------------------------------------

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

  # -- Placement -------------------------------------------------------------

  @abc.abstractmethod
  def create_state(self, init_fn: InitFn, rng: jax.Array) -> PyTree:
    """Builds the train state on devices from `init_fn(rng) -> state`.

    Ensemble strategies call `init_fn` once per member with `member_rng(rng, i)`.
    """

  @abc.abstractmethod
  def put_batch(self, batch: PyTree) -> PyTree:
    """Moves this process's rows of a global batch (`process_slice`) to devices.

    On one process those are the whole batch.
    """

  @abc.abstractmethod
  def compile_train_step(self, step_fn: StepFn, state: PyTree) -> StepFn:
    """Compiles `step_fn(state, batch) -> (state, metrics)`, donating the state.

    `state` is a placed state whose layout the compiled step keeps. The result
    has `.lower(state, batch)`, as jitted functions do.
    """

  @abc.abstractmethod
  def compile_eval_step(self, eval_fn: StepFn, state: PyTree) -> StepFn:
    """Compiles `eval_fn(state, batch) -> outputs` without donation."""

  # -- In-step collectives (called inside compiled steps) --------------------

  def mean_over_data(self, tree: PyTree) -> PyTree:
    """Averages a pytree over data replicas (gradients, metric sums)."""
    return tree

  def merge_metrics_over_data(self, metrics: PyTree) -> PyTree:
    """Merges a clu metric collection computed on each data replica's shard."""
    return metrics

  def mean_over_members(self, tree: PyTree) -> PyTree:
    """Averages a pytree over ensemble members (member probabilities)."""
    return tree

  def replica_rng(self, rng: jax.Array) -> jax.Array:
    """Makes a step RNG distinct per data replica where each replica sees a shard."""
    return rng

  def whole_batch(self, tree: PyTree) -> PyTree:
    """Per-example outputs over the whole batch where a step sees a batch shard
    and its outputs are not split by the strategy's own output layout."""
    return tree

  def constrain_batch(self, tree: PyTree, *, batch_dim: int = 0) -> PyTree:
    """Per-example arrays made inside a step (microbatches), kept sharded like the batch
    on axis `batch_dim`; the identity where a step sees its own shard already."""
    del batch_dim
    return tree

  @property
  def step_sees_batch_shard(self) -> bool:
    """Whether each step call sees only a shard of a model's batch (per-device steps).

    Then a reduction over the batch inside the model (BatchNorm) must name
    `BATCH_AXIS` to be global; a jit strategy's step sees the global batch.
    """
    return False

  def bind_batch_axis(self, fn: Callable[[PyTree], Any], inputs: PyTree) -> Any:
    """`fn(inputs)` with `BATCH_AXIS` bound, for per-example `inputs` (leading batch axis).

    Where the step sees the whole batch, the axis is a size-1 `vmap` axis, so a
    collective over it is the identity and reductions inside `fn` span the
    batch `fn` sees. Strategies whose compiled step binds the name already
    (pmap, shard_map) call `fn` directly.
    """
    return bind_size_one_batch_axis(fn, inputs)

  def member_index(self) -> jax.Array:
    """Which ensemble member the step is running for (0 without an ensemble)."""
    return jnp.zeros((), jnp.int32)

  # -- Host views --------------------------------------------------------------

  def metrics_to_host(self, metrics: Sequence[PyTree]) -> PyTree:
    """One host metric collection from the outputs of several compiled calls.

    The calls' metrics (steps of a log interval, or eval batches) come to the
    host in one transfer and merge there in numpy, over calls and then over
    this strategy's device axis (`merge_device_axis`): no jax op per metric.
    """
    host = to_host(list(metrics))
    return self.merge_device_axis(functools.reduce(lambda a, b: a.merge(b), host))

  def merge_device_axis(self, metrics: PyTree) -> PyTree:
    """Host metrics in this strategy's output layout as one collection (no device axis)."""
    return metrics

  def outputs_to_host(self, outputs: PyTree) -> PyTree:
    """Per-example outputs as host arrays with the global batch as leading axis."""
    return to_host(outputs)

  def to_canonical(self, tree: PyTree) -> PyTree:
    """State (or params) as host arrays in the strategy-independent layout.

    Non-ensemble strategies give one copy of each array, unreplicated and
    unsharded; ensemble strategies give a leading member axis: the checkpoint
    layout, on the host.
    """
    return to_host(self.checkpoint_state(tree))

  # -- Checkpoint layout ---------------------------------------------------------
  # On disk a state is stored once per model: one copy of each array for a
  # single model, a leading member axis for an ensemble. The arrays stay on
  # devices (orbax writes each shard), nothing is gathered onto one host.

  def checkpoint_state(self, state: PyTree) -> PyTree:
    """The placed state as device arrays in the checkpoint layout."""
    return state

  @abc.abstractmethod
  def checkpoint_target(self, abstract_state: PyTree) -> PyTree:
    """Where restored arrays go: `ShapeDtypeStruct`s with this strategy's shardings.

    Args:
      abstract_state: the abstract state of ONE model (`jax.eval_shape` of the
        init function); ensemble strategies add the member axis.
    """

  def from_checkpoint(self, state: PyTree) -> PyTree:
    """Turns arrays restored into `checkpoint_target` into a placed state."""
    return state

  def summary(self, state: PyTree) -> str:
    """`describe()` plus the state's per-parameter layout and bytes per device."""
    from strategies.summary import summarize
    return summarize(self, state)

  def describe(self) -> str:
    """A one-line summary of the device layout."""
    return f"{self.name}: {self.num_members} member(s), {self.num_data_replicas} data replica(s)"


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


def keypath_str(path: tuple, *, drop_box: bool = False) -> str:
  """`params/layers/W1` for a jax key path; `drop_box` leaves out Flax's `value` box field."""
  names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
  if drop_box and names and names[-1] == "value" and isinstance(path[-1],
                                                                jax.tree_util.GetAttrKey):
    names = names[:-1]
  return "/".join(names)


def abstract_with_sharding(abstract: PyTree, sharding: jax.sharding.Sharding,
                           leading: tuple[int, ...] = ()) -> PyTree:
  """`ShapeDtypeStruct`s of `abstract`'s leaves, `leading` axes prepended, on `sharding`."""
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(leading + tuple(x.shape), x.dtype, sharding=sharding),
      abstract)


def merge_along_leading_axis(collection: PyTree) -> PyTree:
  """Merges a host clu `Collection` over the leading axis of its arrays (members), in numpy.

  The result is what `Collection.reduce()` gives (each metric's own
  `_reduce_merge`, so `LastValue` averages), but clu runs a `lax.scan` per
  metric for it, about 0.1 s on host arrays; here each merge is a few numpy
  additions.
  """

  def merge(metric):
    parts = [jax.tree.map(lambda x, i=i: x[i], metric)
             for i in range(np.shape(jax.tree.leaves(metric)[0])[0])]
    return functools.reduce(lambda a, b: a._reduce_merge(b), parts)

  return type(collection)(**{name: merge(m) for name, m in vars(collection).items()})


def first_along_leading_axis(tree: PyTree) -> PyTree:
  """Host copy of element 0 of every leaf's leading axis."""
  return jax.tree.map(lambda x: np.asarray(x[0]), to_host(tree))


def to_host(tree: PyTree) -> PyTree:
  """Host copies of a pytree's arrays, whole, in every process.

  An array sharded over devices of several processes is gathered from all of
  them (`process_allgather`, a collective: every process must call this at the
  same point); replicated and process-local arrays are read where they are.
  """
  def spans_processes(x):
    return (isinstance(x, jax.Array) and not x.is_fully_addressable
            and not x.is_fully_replicated)

  if not any(spans_processes(x) for x in jax.tree.leaves(tree)):
    return jax.device_get(tree)
  from jax.experimental import multihost_utils
  return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
                      if spans_processes(x) else jax.device_get(x), tree)


class GlobalMeshBatch:
  """Mixin for jit strategies whose batch is one global array laid out by `_batch_sharding`.

  Each process puts its own rows; which rows those are depends only on the
  sharding, so it is worked out once, not per batch.
  """

  _batch_sharding: jax.sharding.Sharding

  @functools.cached_property
  def _process_rows(self) -> tuple[int, int]:
    return process_rows_of(self._batch_sharding, self.num_data_replicas)

  def process_rows(self) -> tuple[int, int]:
    return self._process_rows

  def put_batch(self, batch: PyTree) -> PyTree:
    count = self._process_rows[1]
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
        self._batch_sharding, x, (np.shape(x)[0] * count,) + np.shape(x)[1:]), batch)


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
