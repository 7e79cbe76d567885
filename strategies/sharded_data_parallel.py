"""`jax.jit` over a device `Mesh`, with layouts from Flax logical-axis rules.

One rule table maps the logical names a module annotates (`batch`, `embed`,
`hidden`, ...) to mesh axes. The batch is sharded by the rule for `batch`;
parameters and optimizer state by their own annotations. Data parallelism,
FSDP and tensor parallelism are all just different tables and mesh shapes.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Sequence

import flax.linen as nn
import jax
import ml_collections
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from strategies.base import InitFn, PyTree, StepFn, Strategy
from strategies.mesh import GlobalMeshBatch
from strategies.registry import register
from strategies.tree import keypath_str

LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


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


def check_rules(rules: Sequence, mesh_axes: Sequence[str]) -> LogicalRules:
  """Validates a logical-axis rule table against the mesh axes and normalises it.

  Raises:
    ValueError: a rule is malformed or names a mesh axis the mesh does not have.
  """
  checked = []
  for rule in rules:
    if len(rule) != 2 or not isinstance(rule[0], str):
      raise ValueError(
          f"config.strategy.logical_axis_rules entry {rule!r} must be a pair "
          f"(logical_name, mesh_axis | tuple of mesh axes | None).")
    logical, target = rule
    targets = (target,) if isinstance(target, str) or target is None else tuple(target)
    unknown = [t for t in targets if t is not None and t not in mesh_axes]
    if unknown:
      raise ValueError(
          f"config.strategy.logical_axis_rules maps {logical!r} to mesh axis "
          f"{unknown[0]!r}, but the mesh axes are {tuple(mesh_axes)}.")
    checked.append((logical, target if target is None or isinstance(target, str)
                    else tuple(target)))
  return tuple(checked)


def check_one_mesh_axis_per_parameter(logical_specs: PyTree, rules: LogicalRules) -> None:
  """Raises if a rule table sends two logical axes of one array to the same mesh axis.

  Flax would silently replicate the second axis instead; a table that asks
  for it is almost always a mistake (e.g. `embed -> data` and `mlp -> data`
  make the `(embed, mlp)` kernel ask for `data` twice).

  Args:
    logical_specs: `nn.get_partition_spec` of an abstract state (logical names).
  """
  first_rule: dict[str, tuple[str, ...]] = {}
  for logical, target in rules:
    if logical not in first_rule:
      first_rule[logical] = (() if target is None else (target,) if isinstance(target, str)
                             else tuple(target))
  for path, spec in jax.tree_util.tree_leaves_with_path(
      logical_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)):
    if not isinstance(spec, PartitionSpec):
      continue
    used: dict[str, str] = {}
    for name in spec:
      for names in ((name,) if isinstance(name, str) else tuple(name or ())):
        for mesh_axis in first_rule.get(names, ()):
          if mesh_axis in used:
            where = keypath_str(path)
            raise ValueError(
                f"config.strategy.logical_axis_rules maps logical axes {used[mesh_axis]!r} "
                f"and {names!r} of parameter {where!r} (logical axes {tuple(spec)}) to the "
                f"same mesh axis {mesh_axis!r}; an array can use a mesh axis once. Map one "
                f"of them to another mesh axis or to None.")
          used[mesh_axis] = names


def warn_if_no_parameter_is_sharded(logical_specs: PyTree, rules: LogicalRules) -> None:
  """Warns when the table has parameter rules (besides `batch`) but none matches a parameter.

  Such a table usually means the model annotates other logical names (or none):
  every device then holds the whole model and the mesh axes those rules name
  do the same work on every device.

  Args:
    logical_specs: `nn.get_partition_spec` of an abstract state (logical names).
  """
  parameter_rules = [(logical, target) for logical, target in rules
                     if logical != "batch" and target is not None]
  if not parameter_rules:
    return
  annotated = set()
  for spec in jax.tree.leaves(logical_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)):
    if isinstance(spec, PartitionSpec):
      for name in spec:
        annotated.update((name,) if isinstance(name, str) else tuple(name or ()))
  if not any(logical in annotated for logical, _ in parameter_rules):
    warnings.warn(
        f"config.strategy.logical_axis_rules: no parameter is sharded; the rule(s) "
        f"{', '.join(map(repr, parameter_rules))} match no logical axis of the model's "
        f"parameters (they are annotated with {sorted(annotated) or 'no logical axes'}), so "
        f"every device holds the whole model. Name the model's logical axes in the rules, or "
        f"drop the rules for plain data parallelism.", UserWarning, stacklevel=2)


@register("sharded_data_parallel")
class ShardedDataParallel(GlobalMeshBatch, Strategy):
  """`jit` with in/out shardings over a mesh built from the config.

  The mesh uses `Auto` axis types: Flax's `with_logical_constraint` becomes a
  `with_sharding_constraint` hint that XLA's partitioner propagates from,
  which is how the Flax guides use it (under `Explicit` axes it is an
  assertion that fails on unannotated intermediates).

  On a multi-process run the mesh holds every process's devices (in process
  order, so each process feeds a consecutive block of the batch rows).
  """

  @property
  def num_devices(self) -> int:
    return self.mesh.size


  def __init__(self, mesh_shape: Sequence[int], mesh_axes: Sequence[str],
               logical_axis_rules: Sequence, devices: Sequence[jax.Device] | None = None):
    devices = list(devices or jax.devices())
    shape = resolve_mesh_shape(mesh_shape, mesh_axes, len(devices))
    self.rules = check_rules(logical_axis_rules, mesh_axes)
    self.mesh = jax.make_mesh(shape, tuple(mesh_axes), axis_types=(AxisType.Auto,) * len(shape),
                              devices=devices)
    self.batch_spec = nn.logical_to_mesh_axes(("batch",), self.rules)
    self._batch_sharding = NamedSharding(self.mesh, self.batch_spec)

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> ShardedDataParallel:
    return cls(config.strategy.mesh_shape, config.strategy.mesh_axes,
               config.strategy.logical_axis_rules)

  @property
  def num_data_replicas(self) -> int:
    axes = self.batch_spec[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(self.mesh.shape[a] for a in axes)

  @contextlib.contextmanager
  def _context(self):
    """The mesh and rules that Flax's logical annotations read while tracing."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      yield

  def state_shardings(self, abstract_state: PyTree) -> PyTree:
    """NamedShardings for a state from its logical annotations alone."""
    specs = nn.get_partition_spec(abstract_state)
    check_one_mesh_axis_per_parameter(specs, self.rules)
    warn_if_no_parameter_is_sharded(specs, self.rules)
    return nn.logical_to_mesh_sharding(specs, self.mesh, self.rules)

  def checkpoint_target(self, abstract_state: PyTree) -> PyTree:
    def with_sharding(x, sharding):
      if isinstance(x, nn.Partitioned):  # The sharding tree has no boxes.
        return x.replace_boxed(with_sharding(x.value, sharding))
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(with_sharding, abstract_state, self.state_shardings(abstract_state),
                        is_leaf=lambda x: isinstance(x, nn.Partitioned))

  def create_state(self, init_fn: InitFn, rng: jax.Array) -> PyTree:
    with self._context():
      shardings = self.state_shardings(jax.eval_shape(init_fn, rng))
      return jax.jit(init_fn, out_shardings=shardings)(rng)

  def constrain_batch(self, tree: PyTree, *, batch_dim: int = 0) -> PyTree:
    def constrain(x):
      spec = PartitionSpec(*([None] * batch_dim), self.batch_spec[0])
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

  def compile_train_step(self, step_fn: StepFn, state: PyTree) -> StepFn:
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    replicated = NamedSharding(self.mesh, PartitionSpec())
    return self._compile(step_fn, in_shardings=(state_sh, self._batch_sharding),
                         out_shardings=(state_sh, replicated), donate_argnums=0)

  def compile_train_chunk(self, chunk_fn: StepFn, state: PyTree) -> StepFn:
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    replicated = self._replicated_sharding
    return self._compile(chunk_fn, in_shardings=(state_sh, self._stacked_batch_sharding,
                                                 replicated),
                         out_shardings=(state_sh, replicated), donate_argnums=0)

  def compile_eval_step(self, eval_fn: StepFn, state: PyTree) -> StepFn:
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    return self._compile(eval_fn, in_shardings=(state_sh, self._batch_sharding))

  def describe(self) -> str:
    mesh = ", ".join(f"{a}={n}" for a, n in self.mesh.shape.items())
    return (f"{self.name}: mesh ({mesh}), batch {self.batch_spec}, "
            f"{self.num_data_replicas} data replica(s), rules {self.rules}")
