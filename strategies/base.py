"""The Strategy interface: how a run's state and batches are laid out on devices.

A `Trainer` writes its step functions once, in single-replica terms. A strategy
answers every question about devices: how state is created and placed, how a
host batch becomes device arrays, how a step is compiled, which collectives the
step needs, and how device results come back to the host in a layout that does
not depend on the strategy. The collectives default to identities, which is
exactly what the single-device reference needs. Capabilities are mixins in
`strategies.capabilities`: every strategy has a process layout (`OneProcess`,
or `GlobalMeshBatch` for a batch spread over processes), and ensemble
strategies are an `Ensemble`.
"""

from __future__ import annotations

import abc
import functools
import os
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from strategies.mesh import bind_size_one_batch_axis
from strategies.tree import to_host

PyTree = Any
InitFn = Callable[[jax.Array], PyTree]
StepFn = Callable[..., Any]

#: XLA's options for the program that makes a state from its RNG on XLA:CPU
#: (`init_compiler_options`): LLVM's optimization level 1 instead of XLA's default, 3.
CPU_INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


def init_compiler_options(devices: Sequence[jax.Device]) -> dict[str, Any] | None:
  """The compiler options of a state's init program (`create_state`) on `devices`.

  The program runs once per run, so its compile time is most of its cost. On XLA:CPU
  it compiles at LLVM's optimization level 1 (`CPU_INIT_COMPILER_OPTIONS`): the MNIST
  CNN's init took 0.8 s to compile against 2.9 s at the default level, and its values
  are the initializers' own (`tests/test_equivalence.py` holds them equal to the program
  compiled with XLA's defaults). Elsewhere (GPU, TPU): XLA's defaults (None). A level the
  process's `XLA_FLAGS` set is theirs (`cpu_compiler_options`).
  """
  return cpu_compiler_options(devices, CPU_INIT_COMPILER_OPTIONS)


def cpu_compiler_options(devices: Iterable[jax.Device], options: dict[str, Any]
                         ) -> dict[str, Any] | None:
  """A copy of `options` for a program on `devices` if they are all XLA:CPU's, else
  XLA's defaults (None): the options of a program whose compile time on a CPU is most
  of its cost (a state's init, the dry run's step). An option the process's `XLA_FLAGS`
  set (`--name=value`) is left out, so the flag holds for these programs as for every
  other: a user who asks XLA for an optimization level gets it everywhere."""
  if not all(d.platform == "cpu" for d in devices):
    return None
  named = set(re.findall(r"--(\w+)=", os.environ.get("XLA_FLAGS", "")))
  return {k: v for k, v in options.items() if k not in named} or None


class Strategy(abc.ABC):
  """Places state and batches on devices and compiles step functions.

  Subclasses implement the abstract layout methods; the in-step collectives
  (`mean_over_data`, `mean_over_members`, `replica_rng`) are identities here
  and are overridden only by strategies whose step runs per device.
  """

  #: The name the strategy is registered under (`config.strategy.name`).
  name: str = ""
  #: Where the outputs of a compiled chunk (`compile_train_chunk`) keep their step
  #: axis on the host: 0, or 1 behind the strategy's own leading axis (devices,
  #: members). Taking index i along it gives step i's outputs in `put_batch` layout.
  steps_axis: int = 0

  @property
  @abc.abstractmethod
  def num_data_replicas(self) -> int:
    """How many parts the global batch is split into."""

  @property
  def batch_multiple(self) -> int:
    """What every batch a step sees must be a multiple of; eval batches are padded to it."""
    return self.num_data_replicas

  @property
  @abc.abstractmethod
  def num_devices(self) -> int:
    """How many devices a step runs on (over every process)."""

  def shards_of(self, logical_name: str) -> int:
    """How many pieces this layout splits a parameter dimension annotated `logical_name`
    into (1: whole on every device): what that width must be a multiple of (a model pads
    its vocabulary to it, `models.vocab`)."""
    del logical_name
    return 1

  def check_batch_size(self, global_batch_size: int) -> None:
    """Raises ValueError unless the global batch splits evenly over the data replicas."""
    replicas = self.num_data_replicas
    if global_batch_size <= 0 or global_batch_size % replicas:
      raise ValueError(
          f"config.batch_size={global_batch_size} must be a positive multiple of the "
          f"{replicas} data replicas of strategy {self.name!r}; "
          f"try {max(replicas, global_batch_size - global_batch_size % replicas)}.")

  # -- Placement -------------------------------------------------------------

  @abc.abstractmethod
  def create_state(self, init_fn: InitFn, rng: jax.Array) -> PyTree:
    """Builds the train state on devices from `init_fn(rng) -> state`.

    Ensemble strategies call `init_fn` once per member with `member_rng(rng, i)`.
    """

  @abc.abstractmethod
  def put_batch(self, batch: PyTree) -> PyTree:
    """Moves this process's rows of a global batch (its process layout's `process_slice`)
    to devices.

    On one process those are the whole batch.
    """

  #: How many models' batches a host batch holds on a leading axis (an ensemble whose
  #: members each read their own data, `config.data.member_sources`); 0: one batch, which
  #: every model reads.
  batch_models = 0

  def model_batches(self, batch: PyTree) -> list[PyTree]:
    """The batches the models read of a host batch: each member's own (`batch_models`),
    or the one every model reads."""
    if not self.batch_models:
      return [batch]
    return [jax.tree.map(lambda x, m=m: x[m], batch) for m in range(self.batch_models)]

  def put_batches(self, batches: PyTree) -> PyTree:
    """Moves several steps' batches stacked on a leading step axis (host shape
    `(steps, rows, ...)`) to devices, each step's batch laid out as `put_batch` lays it."""
    return self.put_batch(batches)

  @abc.abstractmethod
  def put_replicated(self, tree: PyTree) -> PyTree:
    """Places host arrays whole on every device of the strategy (a device-resident dataset)."""

  @abc.abstractmethod
  def compile_train_step(self, step_fn: StepFn, state: PyTree) -> StepFn:
    """Compiles `step_fn(state, batch) -> (state, metrics)`, donating the state.

    `state` is a placed state whose layout the compiled step keeps. The result
    has `.lower(state, batch)`, as jitted functions do.
    """

  @abc.abstractmethod
  def compile_train_chunk(self, chunk_fn: StepFn, state: PyTree) -> StepFn:
    """Compiles `chunk_fn(state, batches, data) -> (state, outputs)`, donating the state.

    `chunk_fn` runs several train steps of one model as `compile_train_step`'s
    `step_fn` runs one: `batches` (placed by `put_batches`, or None) carry a
    leading step axis in front of each step's batch, `data` (placed by
    `put_replicated`, or None) is the same on every device, and the outputs
    gain a step axis at `steps_axis`.
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

  def replica_rng(self, rng: jax.Array) -> jax.Array:
    """Makes a step RNG distinct per data replica where each replica sees a shard."""
    return rng

  def replica_rows(self, rows: jax.Array) -> jax.Array:
    """Of the global batch's row indices, the ones this step sees (its batch shard's)."""
    return rows

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

  def in_sequence_layout(self, apply: Callable[..., Any]) -> Callable[..., Any]:
    """`apply(params, model_state, batch, ...) -> (outputs, model_state)` as the step calls
    it: as it is, unless the strategy holds sequences in another order (context
    parallelism's load-balanced layout, `strategies.context.in_layout`), which puts the
    batch in that order before the model and its outputs back before the loss."""
    return apply

  def bind_batch_axis(self, fn: Callable[[PyTree], Any], inputs: PyTree) -> Any:
    """`fn(inputs)` with `BATCH_AXIS` bound, for per-example `inputs` (leading batch axis).

    Where the step sees the whole batch, the axis is a size-1 `vmap` axis, so a
    collective over it is the identity and reductions inside `fn` span the
    batch `fn` sees. Strategies whose compiled step binds the name already
    (pmap, shard_map) call `fn` directly.
    """
    return bind_size_one_batch_axis(fn, inputs)

  # -- Host views --------------------------------------------------------------

  def metrics_to_host(self, metrics: Sequence[PyTree]) -> PyTree:
    """One host metric collection from the outputs of several compiled calls.

    The calls' metrics (steps of a log interval, or eval batches) come to the
    host in one transfer and merge there in numpy, over calls and then over
    this strategy's device axis (`merge_device_axis`): no jax op per metric.
    """
    return self.merge_host_metrics(self.fetch_metrics(metrics))

  def fetch_metrics(self, metrics: Sequence[PyTree]) -> list[PyTree]:
    """Several calls' metrics as host trees, in one transfer, in the calls' layout."""
    return to_host(list(metrics))

  def merge_host_metrics(self, metrics: Sequence[PyTree]) -> PyTree:
    """Merges host metrics (`fetch_metrics`, or steps of them) into one collection."""
    return self.merge_device_axis(functools.reduce(lambda a, b: a.merge(b), metrics))

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

  def checkpoint_layout(self) -> dict[str, Any]:
    """What a checkpoint records about the layout besides its arrays (0 members: one model)."""
    return {"num_members": 0, "strategy": self.name}

  @abc.abstractmethod
  def checkpoint_target(self, abstract_state: PyTree) -> PyTree:
    """Where restored arrays go: a `ShapeDtypeStruct` per leaf, with this strategy's shardings.

    Args:
      abstract_state: the abstract state of ONE model (`jax.eval_shape` of the
        init function); ensemble strategies add the member axis.
    """

  def from_checkpoint(self, state: PyTree) -> PyTree:
    """Turns arrays restored into `checkpoint_target` into a placed state."""
    return state

  def describe(self) -> str:
    """A one-line summary of the device layout."""
    return f"{self.name}: one model, {self.num_data_replicas} data replica(s)"


