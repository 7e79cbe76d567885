"""The reference strategy: one model on one device under plain `jax.jit`."""

from __future__ import annotations

import jax
import ml_collections

from strategies.base import InitFn, PyTree, StepFn, Strategy, init_compiler_options
from strategies.mesh import OneProcess
from strategies.registry import register
from strategies.tree import abstract_with_sharding


@register("single_device")
class SingleDevice(OneProcess, Strategy):
  """Everything on one device; every collective is the identity."""

  @property
  def num_devices(self) -> int:
    return 1

  def __init__(self, device: jax.Device | None = None):
    self.device = device or jax.local_devices()[0]

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> SingleDevice:
    del config  # Nothing to configure.
    return cls()

  @property
  def num_data_replicas(self) -> int:
    return 1

  def create_state(self, init_fn: InitFn, rng: jax.Array) -> PyTree:
    return jax.jit(init_fn, out_shardings=jax.sharding.SingleDeviceSharding(self.device),
                   compiler_options=init_compiler_options([self.device]))(rng)

  def put_batch(self, batch: PyTree) -> PyTree:
    return jax.device_put(batch, self.device)

  def compile_train_step(self, step_fn: StepFn, state: PyTree) -> StepFn:
    del state  # Outputs stay on the device of the inputs.
    return jax.jit(step_fn, donate_argnums=0)

  def put_replicated(self, tree: PyTree) -> PyTree:
    return jax.device_put(tree, self.device)

  def compile_train_chunk(self, chunk_fn: StepFn, state: PyTree) -> StepFn:
    del state
    return jax.jit(chunk_fn, donate_argnums=0)

  def compile_eval_step(self, eval_fn: StepFn, state: PyTree) -> StepFn:
    del state
    return jax.jit(eval_fn)

  def checkpoint_target(self, abstract_state: PyTree) -> PyTree:
    sharding = jax.sharding.SingleDeviceSharding(self.device)
    return abstract_with_sharding(abstract_state, sharding)
