"""Data parallelism under `jax.pmap`: replicated state, split batch, `pmean` of gradients."""

from __future__ import annotations

from collections.abc import Sequence

import flax.jax_utils
import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from strategies.base import InitFn, PyTree, StepFn, Strategy, init_compiler_options
from strategies.mesh import BATCH_AXIS, OneProcess
from strategies.registry import register
from strategies.tree import abstract_with_sharding

AXIS = BATCH_AXIS  # Bound by pmap: BatchNorm(axis_name="batch") averages over replicas.


@register("pmap_data_parallel")
class PmapDataParallel(OneProcess, Strategy):
  """One replica of the state per local device; each device takes 1/n of the batch.

  The step runs per device under `pmap(axis_name='batch')`; gradients and
  metrics are averaged with `lax.pmean` over that axis, so every replica
  applies the same update as a single device would on the whole batch, and a
  BatchNorm with `axis_name='batch'` normalises over the global batch. Dropout
  differs from a single device: each replica folds its index into the step RNG
  (`replica_rng`), so its masks are independent draws, not a slice of the
  single-device mask.
  """

  @property
  def num_devices(self) -> int:
    return len(self.devices)

  steps_axis = 1  # Chunk outputs: (devices, steps, ...).

  def __init__(self, devices: list[jax.Device] | None = None):
    self.devices = list(devices or jax.local_devices())
    mesh = Mesh(np.array(self.devices), (AXIS,))
    self._batch_sharding = NamedSharding(mesh, PartitionSpec(AXIS))
    self._replicated = NamedSharding(mesh, PartitionSpec())

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> PmapDataParallel:
    del config  # Uses every local device.
    return cls()

  @property
  def num_data_replicas(self) -> int:
    return len(self.devices)

  def create_state(self, init_fn: InitFn, rng: jax.Array) -> PyTree:
    state = jax.jit(init_fn, compiler_options=init_compiler_options(self.devices[:1]))(rng)
    # Placed on the step's own axis name: pmap keys its cache on input shardings,
    # so any other name would compile the step a second time.
    return flax.jax_utils.replicate(state, devices=self.devices, axis_name=AXIS)

  def put_batch(self, batch: PyTree) -> PyTree:
    n = self.num_data_replicas

    def split(x):
      x = np.asarray(x)
      if x.shape[0] % n:
        raise ValueError(
            f"a batch with leading dimension {x.shape[0]} does not split over "
            f"{n} data replicas of strategy {self.name!r}")
      return x.reshape((n, x.shape[0] // n) + x.shape[1:])

    return jax.device_put(jax.tree.map(split, batch), self._batch_sharding)

  def put_batches(self, batches: PyTree) -> PyTree:
    n = self.num_data_replicas

    def split(x):  # (steps, rows, ...) -> (devices, steps, rows / devices, ...)
      x = np.asarray(x)
      if x.shape[1] % n:
        raise ValueError(
            f"a batch with leading dimension {x.shape[1]} does not split over "
            f"{n} data replicas of strategy {self.name!r}")
      return np.swapaxes(x.reshape((x.shape[0], n, x.shape[1] // n) + x.shape[2:]), 0, 1)

    return jax.device_put(jax.tree.map(split, batches), self._batch_sharding)

  def put_replicated(self, tree: PyTree) -> PyTree:
    return jax.device_put(tree, self._replicated)

  @property
  def step_sees_batch_shard(self) -> bool:
    return self.num_data_replicas > 1

  def bind_batch_axis(self, fn, inputs):
    return fn(inputs)  # pmap binds it.

  def compile_train_step(self, step_fn: StepFn, state: PyTree) -> StepFn:
    del state
    return jax.pmap(step_fn, axis_name=AXIS, devices=self.devices, donate_argnums=(0,))

  def compile_train_chunk(self, chunk_fn: StepFn, state: PyTree) -> StepFn:
    del state  # The dataset is placed whole on every device (`put_replicated`): in_axes None.
    return jax.pmap(chunk_fn, axis_name=AXIS, in_axes=(0, 0, None), devices=self.devices,
                    donate_argnums=(0,))

  def compile_eval_step(self, eval_fn: StepFn, state: PyTree) -> StepFn:
    del state
    return jax.pmap(eval_fn, axis_name=AXIS, devices=self.devices)

  def mean_over_data(self, tree: PyTree) -> PyTree:
    return jax.lax.pmean(tree, AXIS)

  def merge_metrics_over_data(self, metrics: PyTree) -> PyTree:
    # clu's own cross-device reduction: exact for every metric type (sums, not means).
    return jax.lax.all_gather(metrics, AXIS).reduce()

  def replica_rows(self, rows: jax.Array) -> jax.Array:
    return rows.reshape(self.num_data_replicas, -1)[jax.lax.axis_index(AXIS)]

  def replica_rng(self, rng: jax.Array) -> jax.Array:
    return jax.random.fold_in(rng, jax.lax.axis_index(AXIS))

  def fetch_metrics(self, metrics: Sequence[PyTree]) -> list[PyTree]:
    # Identical on every replica after the in-step merge: fetch device 0's copy only.
    return super().fetch_metrics(
        [jax.tree.map(lambda x: x.addressable_shards[0].data, m) for m in metrics])

  def merge_device_axis(self, metrics: PyTree) -> PyTree:
    return jax.tree.map(lambda x: x[0], metrics)  # Device 0's slice of the replica axis.

  def outputs_to_host(self, outputs: PyTree) -> PyTree:
    return jax.tree.map(
        lambda x: np.asarray(x).reshape((-1,) + x.shape[2:]), jax.device_get(outputs))

  def checkpoint_state(self, state: PyTree) -> PyTree:
    # Every replica is the same: store device 0's copy, once.
    return jax.tree.map(lambda x: x.addressable_shards[0].data[0], state)

  def checkpoint_target(self, abstract_state: PyTree) -> PyTree:
    # Orbax reads a full copy onto every device; `from_checkpoint` stacks them.
    return abstract_with_sharding(abstract_state, self._replicated)

  def from_checkpoint(self, state: PyTree) -> PyTree:
    def stack(x):
      by_device = {s.device: s.data for s in x.addressable_shards}
      return jax.make_array_from_single_device_arrays(
          (len(self.devices),) + x.shape, self._batch_sharding,
          [by_device[d][None] for d in self.devices])

    return jax.tree.map(stack, state)
