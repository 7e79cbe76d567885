"""Ensembles under `jax.pmap`: one independently initialised member per device."""

from __future__ import annotations

from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from strategies.base import InitFn, PyTree, StepFn, Strategy, init_compiler_options
from strategies.capabilities import Ensemble, ensemble_size, sweep_seeds
from strategies.mesh import OneProcess
from strategies.registry import register
from strategies.tree import abstract_with_sharding

AXIS = "ensemble"


@register("pmap_ensemble")
class PmapEnsemble(Ensemble, OneProcess, Strategy):
  """Member i lives on local device i and is initialised from `member_rng(rng, i)`.

  Every device sees the whole batch. Losses and gradients stay per member (no
  collective in the train step); only ensemble predictions average member
  probabilities with `lax.pmean` over the `ensemble` axis.
  """

  @property
  def num_devices(self) -> int:
    return len(self.devices)

  steps_axis = 1  # Chunk outputs: (members, steps, ...).

  def __init__(self, num_members: int, devices: list[jax.Device] | None = None):
    self.devices = list(devices or jax.local_devices())
    if num_members != len(self.devices):
      raise ValueError(
          f"config.ensemble_size={num_members} but strategy 'pmap_ensemble' places one "
          f"member on each of the {len(self.devices)} local devices; set ensemble_size="
          f"{len(self.devices)}, or change the device count (e.g. config.num_cpu_devices "
          f"on CPU).")
    self.num_members = num_members
    mesh = Mesh(np.array(self.devices), (AXIS,))
    self._replicated = NamedSharding(mesh, PartitionSpec())
    self._per_member = NamedSharding(mesh, PartitionSpec(AXIS))
    self._inits: dict[InitFn, Callable] = {}  # create_state's compiled init programs.

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> PmapEnsemble:
    strategy = cls(num_members=ensemble_size(config, jax.local_device_count()))
    strategy.member_seeds = sweep_seeds(config)
    return strategy

  @property
  def num_data_replicas(self) -> int:
    return 1

  def create_state(self, init_fn: InitFn, rng: jax.Array) -> PyTree:
    rngs = self.member_rngs(rng)
    if init_fn not in self._inits:  # Compiled once per init_fn, as a pmap call would be.
      # Same axis name as the steps, so the first step reuses the compiled program.
      init = jax.pmap(init_fn, axis_name=AXIS, devices=self.devices)
      self._inits[init_fn] = init.lower(rngs).compile(
          compiler_options=init_compiler_options(self.devices))
    return self._inits[init_fn](rngs)

  def put_batch(self, batch: PyTree) -> PyTree:
    return jax.device_put(batch, self._replicated)

  def compile_train_step(self, step_fn: StepFn, state: PyTree) -> StepFn:
    del state
    return jax.pmap(step_fn, axis_name=AXIS, in_axes=(0, None), devices=self.devices,
                    donate_argnums=(0,))

  def put_replicated(self, tree: PyTree) -> PyTree:
    return jax.device_put(tree, self._replicated)

  def compile_train_chunk(self, chunk_fn: StepFn, state: PyTree) -> StepFn:
    del state
    return jax.pmap(chunk_fn, axis_name=AXIS, in_axes=(0, None, None), devices=self.devices,
                    donate_argnums=(0,))

  def compile_eval_step(self, eval_fn: StepFn, state: PyTree) -> StepFn:
    del state
    return jax.pmap(eval_fn, axis_name=AXIS, in_axes=(0, None), devices=self.devices)

  def mean_over_members(self, tree: PyTree) -> PyTree:
    return jax.lax.pmean(tree, AXIS)

  def member_index(self) -> jax.Array:
    return jax.lax.axis_index(AXIS)

  def checkpoint_target(self, abstract_state: PyTree) -> PyTree:
    # Member i is read straight onto device i: the layout the pmapped step takes.
    return abstract_with_sharding(abstract_state, self._per_member,
                          leading=(self.num_members,))
