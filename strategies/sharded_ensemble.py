"""Ensembles under `jax.jit`: members stacked on a leading axis, sharded over a mesh.

The member axis is split over the mesh axis `ensemble`; a second mesh axis,
`data`, splits each member's batch (data parallelism inside every member).
Any member count that divides over the `ensemble` axis works: one member per
device, several per device (16 members on 8 devices, 4 on one device), or all
on one. The members that share a device run either vectorised (`vmap`) or
one after another (unrolled into the program, or a `lax.map` loop), chosen by
`config.strategy.ensemble_loop`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from strategies.base import InitFn, PyTree, StepFn, Strategy, init_compiler_options
from strategies.capabilities import Ensemble, ensemble_size, sweep_seeds
from strategies.mesh import BATCH_AXIS, GlobalMeshBatch
from strategies.registry import register
from strategies.tree import abstract_with_sharding

ENSEMBLE, DATA = "ensemble", BATCH_AXIS  # DATA: BatchNorm(axis_name="batch") reduces over it.
MEMBERS = "members"  # The vmap axis over the members that share a device.
LOOPS = ("unroll", "map", "vmap")


def default_loop(platform: str) -> str:
  """The fastest way to run several members on one device, as measured per platform.

  Measured on XLA:CPU (`benchmarks/ensemble_step_time.py`, README): unrolling
  the members into one program runs at the speed of separate single-model
  steps; `vmap` turns the convolutions into grouped convolutions about 4x
  slower, and `lax.map` (a while loop) 11-20x slower. Elsewhere
  `vmap` gives the compiler one batched program; no GPU/TPU measurement has
  been made in this repository yet.
  """
  return "unroll" if platform == "cpu" else "vmap"


@register("sharded_ensemble")
class ShardedEnsemble(Ensemble, GlobalMeshBatch, Strategy):
  """Member i is initialised from `member_rng(rng, i)` and lives on `ensemble` shard i // k.

  The train step runs under `shard_map`: each device steps its k members with
  its slice of the batch; the only collectives are over `data` (gradient and
  metric means inside a member), never over `ensemble`. Eval and predict
  vectorise the local members so that ensemble means can use a named axis.
  """

  @property
  def num_devices(self) -> int:
    return self.mesh.size

  steps_axis = 1  # Chunk outputs: (members, steps, ...).

  def __init__(self, num_members: int, mesh_shape: Sequence[int] = (-1, 1), loop: str = "",
               devices: Sequence[jax.Device] | None = None):
    devices = list(devices or jax.devices())
    shape = tuple(mesh_shape)
    if (len(shape) != 2 or shape.count(-1) > 1
        or any(not isinstance(n, int) or (n < 1 and n != -1) for n in shape)):
      raise ValueError(
          f"config.strategy.ensemble_mesh_shape={shape} must be two positive integers "
          f"(ensemble devices, data devices per member), one of which may be -1.")
    if -1 in shape:
      known = math.prod(n for n in shape if n != -1)
      if len(devices) % known:
        raise ValueError(
            f"config.strategy.ensemble_mesh_shape={shape} does not fit the {len(devices)} "
            f"devices: {len(devices)} is not a multiple of {known}.")
      shape = tuple(len(devices) // known if n == -1 else n for n in shape)
    if math.prod(shape) > len(devices):
      raise ValueError(
          f"config.strategy.ensemble_mesh_shape={tuple(mesh_shape)} needs "
          f"{math.prod(shape)} devices but {len(devices)} are available.")
    ensemble_devices = shape[0]
    if num_members < 1 or num_members % ensemble_devices:
      raise ValueError(
          f"config.ensemble_size={num_members} does not divide over the {ensemble_devices} "
          f"devices of mesh axis 'ensemble' (config.strategy.ensemble_mesh_shape="
          f"{tuple(mesh_shape)}); use a positive multiple of {ensemble_devices}, or change "
          f"the mesh shape.")
    self.loop = loop or default_loop(devices[0].platform)
    if self.loop not in LOOPS:
      raise ValueError(f"config.strategy.ensemble_loop={loop!r} is not one of {LOOPS} "
                       f"(or '' for the platform's default).")
    self.num_members = num_members
    self.members_per_device = num_members // ensemble_devices
    self.mesh = Mesh(np.array(devices[:math.prod(shape)]).reshape(shape), (ENSEMBLE, DATA))
    self._member_sharding = NamedSharding(self.mesh, PartitionSpec(ENSEMBLE))
    self._batch_sharding = NamedSharding(self.mesh, PartitionSpec(DATA))

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> ShardedEnsemble:
    strategy = cls(num_members=ensemble_size(config, jax.device_count()),
                   mesh_shape=config.strategy.ensemble_mesh_shape,
                   loop=config.strategy.ensemble_loop)
    strategy.member_seeds = sweep_seeds(config)
    return strategy

  @property
  def num_data_replicas(self) -> int:
    return self.mesh.shape[DATA]

  # -- Placement -----------------------------------------------------------------

  def _over_local_members(self, fn: StepFn, loop: str) -> StepFn:
    """`fn(member_state, *inputs)` applied to each member a device holds (the same inputs)."""
    if loop == "vmap":
      return lambda state, *inputs: jax.vmap(
          fn, in_axes=(0,) + (None,) * len(inputs), axis_name=MEMBERS)(state, *inputs)
    if loop == "map":
      return lambda state, *inputs: jax.lax.map(lambda s: fn(s, *inputs), state)

    def unrolled(state, *inputs):  # One copy of the step per local member in the program.
      outs = [fn(jax.tree.map(lambda x, i=i: x[i], state), *inputs)
              for i in range(self.members_per_device)]
      return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)

    return unrolled

  def create_state(self, init_fn: InitFn, rng: jax.Array) -> PyTree:
    rngs = self.member_rngs(rng)
    init = (jax.vmap(init_fn) if self.loop == "vmap"
            else lambda r: jax.lax.map(init_fn, r))
    return jax.jit(init, out_shardings=self._member_sharding,
                   compiler_options=init_compiler_options(self.mesh.devices.flat))(rngs)

  def _compile(self, fn: StepFn, loop: str, out_specs, **jit_kwargs) -> StepFn:
    per_device = jax.shard_map(
        self._over_local_members(fn, loop), mesh=self.mesh,
        in_specs=(PartitionSpec(ENSEMBLE), PartitionSpec(DATA)), out_specs=out_specs,
        check_vma=False)
    return jax.jit(per_device, in_shardings=(self._member_sharding, self._batch_sharding),
                   **jit_kwargs)

  def compile_train_step(self, step_fn: StepFn, state: PyTree) -> StepFn:
    del state
    return self._compile(step_fn, self.loop, PartitionSpec(ENSEMBLE), donate_argnums=0)

  def compile_train_chunk(self, chunk_fn: StepFn, state: PyTree) -> StepFn:
    del state
    per_device = jax.shard_map(
        self._over_local_members(chunk_fn, self.loop), mesh=self.mesh,
        in_specs=(PartitionSpec(ENSEMBLE), PartitionSpec(None, DATA), PartitionSpec()),
        out_specs=PartitionSpec(ENSEMBLE), check_vma=False)
    return jax.jit(per_device, in_shardings=(self._member_sharding,
                                             self._stacked_batch_sharding,
                                             self._replicated_sharding), donate_argnums=0)

  def compile_eval_step(self, eval_fn: StepFn, state: PyTree) -> StepFn:
    del state
    # Vectorised, so that `mean_over_members` has an axis to average over.
    return self._compile(eval_fn, "vmap", PartitionSpec(ENSEMBLE))

  @property
  def step_sees_batch_shard(self) -> bool:
    return self.num_data_replicas > 1

  def bind_batch_axis(self, fn, inputs):
    return fn(inputs)  # shard_map binds the mesh axis.

  # -- In-step collectives ---------------------------------------------------------

  def mean_over_data(self, tree: PyTree) -> PyTree:
    return jax.lax.pmean(tree, DATA) if self.num_data_replicas > 1 else tree

  def merge_metrics_over_data(self, metrics: PyTree) -> PyTree:
    if self.num_data_replicas == 1:
      return metrics
    return jax.lax.all_gather(metrics, DATA).reduce()

  def replica_rows(self, rows: jax.Array) -> jax.Array:
    if self.num_data_replicas == 1:
      return rows
    return rows.reshape(self.num_data_replicas, -1)[jax.lax.axis_index(DATA)]

  def replica_rng(self, rng: jax.Array) -> jax.Array:
    return jax.random.fold_in(rng, jax.lax.axis_index(DATA)) if self.num_data_replicas > 1 \
        else rng

  def mean_over_members(self, tree: PyTree) -> PyTree:
    return jax.lax.pmean(jax.lax.pmean(tree, MEMBERS), ENSEMBLE)

  def member_index(self) -> jax.Array:
    return (jax.lax.axis_index(ENSEMBLE) * self.members_per_device
            + jax.lax.axis_index(MEMBERS))

  def whole_batch(self, tree: PyTree) -> PyTree:
    if self.num_data_replicas == 1:
      return tree
    return jax.lax.all_gather(tree, DATA, axis=0, tiled=True)

  # -- Host views and checkpoints ----------------------------------------------------

  def checkpoint_target(self, abstract_state: PyTree) -> PyTree:
    return abstract_with_sharding(abstract_state, self._member_sharding,
                                  leading=(self.num_members,))

  def describe(self) -> str:
    return (f"{self.name}: {self.num_members} members, mesh (ensemble="
            f"{self.mesh.shape[ENSEMBLE]}, data={self.mesh.shape[DATA]}), "
            f"{self.members_per_device} member(s) per device run with {self.loop}")
