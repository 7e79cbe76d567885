"""`jax.jit` over a device `Mesh`, with layouts from Flax logical-axis rules.

One rule table maps the logical names a module annotates (`batch`, `embed`,
`hidden`, ...) to mesh axes. The batch is sharded by the rule for `batch`;
parameters and optimizer state by their own annotations. Data parallelism,
FSDP and tensor parallelism are all just different tables and mesh shapes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import ml_collections
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from strategies import context as context_lib
from strategies import expert as expert_lib
from strategies import layout
from strategies import pipeline as pipelining
from strategies.base import InitFn, PyTree, StepFn, Strategy, init_compiler_options
from strategies.layout import LogicalRules, check_rules  # noqa: F401 -- their old home.
from strategies.mesh import GlobalMeshBatch
from strategies.registry import register

#: `config.strategy.axis_types` -> the mesh's axis type.
AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def resolve_mesh_shape(mesh_shape: Sequence[int], mesh_axes: Sequence[str],
                       num_devices: int) -> tuple[int, ...]:
  """Checks a mesh shape against the device count, filling in one -1 entry.

  Raises:
    ValueError: the shape and axes disagree, or the product differs from `num_devices`.
  """
  shape, axes = tuple(mesh_shape), tuple(mesh_axes)
  if len(shape) != len(axes) or not axes:
    raise ValueError(
        f"config.strategy.mesh_shape={shape} and config.strategy.mesh_axes={axes} must "
        f"be non-empty and of the same length.")
  if len(set(axes)) != len(axes):
    raise ValueError(f"config.strategy.mesh_axes={axes} names an axis twice.")
  if any(not isinstance(n, int) or (n < 1 and n != -1) for n in shape) or shape.count(-1) > 1:
    raise ValueError(
        f"config.strategy.mesh_shape={shape} must hold positive integers and at most "
        f"one -1 (the axis that takes the remaining devices).")
  known = math.prod(n for n in shape if n != -1)
  if -1 in shape and num_devices % known == 0:
    shape = tuple(num_devices // known if n == -1 else n for n in shape)
  if math.prod(shape) != num_devices:
    raise ValueError(
        f"config.strategy.mesh_shape={tuple(mesh_shape)} covers {math.prod(shape)} "
        f"devices but {num_devices} are available; the product of the mesh shape must "
        f"equal the device count (use -1 for one axis to take the rest).")
  return shape


@register("sharded_data_parallel")
class ShardedDataParallel(GlobalMeshBatch, Strategy):
  """`jit` with in/out shardings over a mesh built from the config.

  `axis_types` chooses the mesh's axis types (`config.strategy.axis_types`):

  - `"auto"` (default): the compiler's partitioner propagates the layouts of
    the inputs, parameters and `with_sharding_constraint` hints (Flax's
    `with_logical_constraint`) to every intermediate, as in Flax's pjit guide.
  - `"explicit"`: every array's sharding is part of its type (`jax.make_mesh`'s
    default since jax 0.9, Flax's current NNX examples): jax infers each
    intermediate's sharding from its inputs' while tracing and refuses an
    ambiguous one; a `with_sharding_constraint` is an assertion, and the batch is
    moved with `jax.sharding.reshard`.

  Parameters are laid out by their annotations in both (`strategies.layout`):
  logical names through the rule table, mesh axis names as written.

  A mesh axis named `stage` pipelines the model's layer stack over it
  (`strategies.pipeline`; the rule `("layer", "stage")` puts each stage's layers on
  its devices), with `pipeline` (`config.strategy.pipeline`) choosing the
  microbatches, repeats and remat.

  A mesh axis named `context` (with the rule `("length", "context")`) splits every
  sequence over it (`strategies.context`): the model's attention
  (`models.attention.attention`) runs by `config.strategy.context.method`, and in the
  load-balanced order the batch is reordered before the model (`in_sequence_layout`).

  A mesh axis named `expert` (with the rules `("expert", "expert")` and the batch over it
  too) splits a mixture of experts' experts over it (`strategies.expert`): each token's
  chosen experts' inputs travel to their devices and back by all-to-all.

  On a multi-process run the mesh holds every process's devices (in process
  order, so each process feeds a consecutive block of the batch rows).
  """

  @property
  def num_devices(self) -> int:
    return self.mesh.size


  def __init__(self, mesh_shape: Sequence[int], mesh_axes: Sequence[str],
               logical_axis_rules: Sequence, devices: Sequence[jax.Device] | None = None, *,
               axis_types: str = "auto", max_replicated_mb: float = 0,
               pipeline: dict | None = None, context: dict | None = None):
    devices = list(devices or jax.devices())
    shape = resolve_mesh_shape(mesh_shape, mesh_axes, len(devices))
    if axis_types not in AXIS_TYPES:
      raise ValueError(f"config.strategy.axis_types={axis_types!r} is not one of "
                       f"{tuple(AXIS_TYPES)}.")
    if not isinstance(max_replicated_mb, int | float) or max_replicated_mb < 0:
      raise ValueError(f"config.strategy.max_replicated_mb={max_replicated_mb!r} must be a "
                       f"number >= 0 (0: no limit).")
    self.rules = check_rules(logical_axis_rules, mesh_axes)
    self.axis_types = axis_types
    self.max_replicated_mb = max_replicated_mb
    self.mesh = jax.make_mesh(shape, tuple(mesh_axes),
                              axis_types=(AXIS_TYPES[axis_types],) * len(shape), devices=devices)
    self.batch_spec = nn.logical_to_mesh_axes(("batch",), self.rules)
    self._batch_sharding = NamedSharding(self.mesh, self.batch_spec)
    self._inits: dict[InitFn, InitFn] = {}  # create_state's jitted init functions.
    #: The layer stack's pipeline over the `stage` axis, or None (no such axis).
    self.pipeline = pipelining.from_mesh(
        dict(self.mesh.shape), self.rules, self.batch_axes, axis_types, **(pipeline or {}))
    #: How attention runs over the `context` axis (`strategies.context`), or None.
    self.context = context_lib.from_mesh(
        dict(self.mesh.shape), self.rules, self.batch_axes, axis_types,
        pipelined=self.pipeline is not None, **(context or {}))
    #: How the MoE feed-forward runs (`strategies.expert`): per device, with an `expert`
    #: axis exchanging tokens by all-to-all; None where the partitioner lays it out.
    self.expert = expert_lib.from_mesh(dict(self.mesh.shape), self.rules, self.batch_axes,
                                       axis_types, pipelined=self.pipeline is not None,
                                       platform=devices[0].platform)

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> ShardedDataParallel:
    return cls(config.strategy.mesh_shape, config.strategy.mesh_axes,
               config.strategy.logical_axis_rules, axis_types=config.strategy.axis_types,
               max_replicated_mb=config.strategy.max_replicated_mb,
               pipeline=pipelining.config_fields(config),
               context=context_lib.config_fields(config))

  @property
  def batch_multiple(self) -> int:
    """The data replicas, times the microbatches where a pipeline cuts the batch."""
    if self.pipeline is None:
      return self.num_data_replicas
    return math.lcm(self.num_data_replicas, self.pipeline.microbatches * self.pipeline.data_shards)

  def check_batch_size(self, global_batch_size: int) -> None:
    super().check_batch_size(global_batch_size)
    if self.pipeline is not None:
      self.pipeline.check_batch(global_batch_size, self.pipeline.data_shards)

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """The mesh axes the batch is split over."""
    return layout.axis_names(self.batch_spec[0])

  @property
  def num_data_replicas(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.batch_axes)

  def shards_of(self, logical_name: str) -> int:
    spec = layout.resolve((logical_name,), self.rules, self.mesh.axis_names)
    return math.prod(self.mesh.shape[a] for a in layout.axis_names(spec[0]))

  @contextlib.contextmanager
  def _context(self):
    """The mesh, and under `auto` the rules Flax's logical constraints read while tracing.

    Under `explicit` Flax's logical constraints are off (a constraint would only
    assert what the array types already say): each intermediate's sharding follows
    from its inputs', and the model states the ambiguous ones (`out_sharding`).
    """
    if self.axis_types == "explicit":
      with jax.set_mesh(self.mesh):
        yield
      return
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(
        layout.with_mesh_axes(self.rules, self.mesh.axis_names)), pipelining.active(
            self.pipeline), context_lib.active(self.context), expert_lib.active(self.expert):
      yield

  def state_shardings(self, abstract_state: PyTree) -> PyTree:
    """NamedShardings for a state from its annotations alone (`strategies.layout`).

    Raises:
      ValueError: the rule table would lay a parameter out other than meant
        (`layout.check_layout`).
    """
    if self.pipeline is not None:
      self.pipeline.check_state(abstract_state)
    expert_lib.check_state(self.expert, abstract_state)
    layout.check_layout(abstract_state, self.rules, dict(self.mesh.shape), self.batch_axes,
                        max_replicated_mb=self.max_replicated_mb)
    return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec),
                        layout.mesh_specs(abstract_state, self.rules, self.mesh.axis_names),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))

  def checkpoint_target(self, abstract_state: PyTree) -> PyTree:
    def with_sharding(x, sharding):
      if isinstance(x, nn.Partitioned):  # The sharding tree has no boxes.
        if not jax.tree.leaves(x.value):  # A frozen parameter's empty optimizer state.
          return x
        return x.replace_boxed(with_sharding(x.value, sharding))
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(with_sharding, abstract_state, self.state_shardings(abstract_state),
                        is_leaf=lambda x: isinstance(x, nn.Partitioned))

  def create_state(self, init_fn: InitFn, rng: jax.Array) -> PyTree:
    """`init_fn` jitted with the layout's shardings: once per `init_fn` (the Trainer's is one
    function per batch shape), so a second state costs a call, not a trace and a compile."""
    with self._context():
      if init_fn not in self._inits:
        shardings = self.state_shardings(jax.eval_shape(init_fn, rng))
        self._inits[init_fn] = jax.jit(
            init_fn, out_shardings=shardings,
            compiler_options=init_compiler_options(self.mesh.devices.flat))
      return self._inits[init_fn](rng)

  def constrain_batch(self, tree: PyTree, *, batch_dim: int = 0) -> PyTree:
    def constrain(x):
      spec = PartitionSpec(*([None] * batch_dim), self.batch_spec[0])
      if self.axis_types == "explicit":  # A constraint would only assert; this moves it.
        return jax.sharding.reshard(x, spec)
      return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    return jax.tree.map(constrain, tree)

  def _compile(self, fn: StepFn, **jit_kwargs) -> StepFn:
    jitted = jax.jit(fn, **jit_kwargs)

    def call(*args):
      with self._context():
        return jitted(*args)

    def lower(*args):
      with self._context():
        return jitted.lower(*args)

    def trace(*args):
      with self._context():
        return jitted.trace(*args)

    # Like a jitted function's: for the compiled program's text and its jaxpr.
    call.lower, call.trace = lower, trace
    return call

  def _pipelined(self, fn: StepFn) -> StepFn:
    if self.context is not None:
      fn = context_lib.requiring_attention(self.context, fn)
    return fn if self.pipeline is None else pipelining.requiring_stack(self.pipeline, fn)

  def in_sequence_layout(self, apply):
    return context_lib.in_layout(self.context, apply)

  def compile_train_step(self, step_fn: StepFn, state: PyTree) -> StepFn:
    step_fn = self._pipelined(step_fn)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    replicated = NamedSharding(self.mesh, PartitionSpec())
    return self._compile(step_fn, in_shardings=(state_sh, self._batch_sharding),
                         out_shardings=(state_sh, replicated), donate_argnums=0)

  def compile_train_chunk(self, chunk_fn: StepFn, state: PyTree) -> StepFn:
    chunk_fn = self._pipelined(chunk_fn)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    replicated = self._replicated_sharding
    return self._compile(chunk_fn, in_shardings=(state_sh, self._stacked_batch_sharding,
                                                 replicated),
                         out_shardings=(state_sh, replicated), donate_argnums=0)

  def compile_eval_step(self, eval_fn: StepFn, state: PyTree) -> StepFn:
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    if self.context is not None:
      eval_fn = context_lib.requiring_attention(self.context, eval_fn)
    return self._compile(eval_fn, in_shardings=(state_sh, self._batch_sharding))

  def describe(self) -> str:
    mesh = ", ".join(f"{a}={n}" for a, n in self.mesh.shape.items())
    return (f"{self.name}: {self.axis_types} mesh ({mesh}), batch {self.batch_spec}, "
            f"{self.num_data_replicas} data replica(s), rules {self.rules}"
            + (f"; {self.pipeline.describe()}" if self.pipeline else "")
            + (f"; {self.context.describe()}" if self.context else "")
            + (f"; {self.expert.describe()}" if self.expert and self.expert.axis else ""))
