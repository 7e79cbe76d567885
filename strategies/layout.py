"""Parameter layouts on a mesh: rule tables that cannot fail silently, and mesh specs as written.

A parameter's annotation is a tuple of names, one per dimension (Linen
`nn.with_logical_partitioning` / `nn.with_partitioning`, NNX
`nnx.with_partitioning(init, names or PartitionSpec)`). Each name is resolved
the same way under `Auto` and `Explicit` mesh axes:

- a name the rule table maps (`config.strategy.logical_axis_rules`) is a
  logical name: it takes its rule's mesh axes (None: replicated);
- a name the table does not map but the mesh has is a mesh axis, laid out as
  written (Flax's current NNX examples put `P(None, 'model')` on a weight);
- any other name is an error (Flax would replicate that dimension silently)
  under either axis type: always in an annotation that names mesh axes by its
  form (Linen `nn.with_partitioning`, an NNX `PartitionSpec`), and in logical
  annotations wherever the layout splits parameters at all. A table that only
  shards the batch, over a model whose annotations name no mesh axis (plain
  data parallelism), replicates every parameter on purpose.

The table itself is checked against the parameters before anything is
placed (`check_layout`): two rules for one logical name, two dimensions of one
parameter on one mesh axis, a parameter rule that matches nothing, a dimension
the mesh axes it is split over do not divide (a published width: 6 heads over 4
devices), and a parameter larger than `max_replicated_mb` replicated over a mesh
axis that does not split the batch (a model axis) are errors or warnings naming
the parameter paths, their shapes and the rule.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from strategies.tree import array_bytes, keypath_str

PyTree = Any
LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]
#: The logical name of the batch dimension; its rule shards the batch, not a parameter.
BATCH = "batch"


def axis_names(entry) -> tuple[str, ...]:
  """The names in one entry of an annotation, a rule's target or a `PartitionSpec` (None,
  a name, or a tuple of names)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _axes_of(name: str, table: Mapping[str, Any], mesh_axes) -> tuple[str, ...] | None:
  """The mesh axes one annotated name lands on: its rule's (a logical name), itself (a mesh
  axis no rule names), or None (neither)."""
  if name in table:
    return axis_names(table[name])
  return (name,) if name in mesh_axes else None


def check_rules(rules: Sequence, mesh_axes: Sequence[str]) -> LogicalRules:
  """Validates a logical-axis rule table against the mesh axes and normalises it.

  Raises:
    ValueError: a rule is malformed, names a mesh axis the mesh does not have,
      or repeats a logical name (Flax uses only its first rule but for a fallback
      when that mesh axis is taken, which `check_layout` refuses: the second is dead).
  """
  checked: list[tuple[str, Any]] = []
  for rule in rules:
    if len(rule) != 2 or not isinstance(rule[0], str):
      raise ValueError(
          f"config.strategy.logical_axis_rules entry {rule!r} must be a pair "
          f"(logical_name, mesh_axis | tuple of mesh axes | None).")
    logical, target = rule
    unknown = [t for t in axis_names(target) if t not in mesh_axes]
    if unknown:
      raise ValueError(
          f"config.strategy.logical_axis_rules maps {logical!r} to mesh axis "
          f"{unknown[0]!r}, but the mesh axes are {tuple(mesh_axes)}.")
    earlier = [r for r in checked if r[0] == logical]
    if earlier:
      raise ValueError(
          f"config.strategy.logical_axis_rules has two rules for {logical!r}: "
          f"{earlier[0]!r} and {(logical, target)!r}. One logical name takes one rule; "
          f"remove one of them.")
    checked.append((logical, target if target is None or isinstance(target, str)
                    else tuple(target)))
  return tuple(checked)


def _is_box(x) -> bool:
  import flax.linen as nn
  return isinstance(x, nn.meta.AxisMetadata)


def _names_of(leaf) -> tuple:
  """The annotation of a leaf: a box's names (Linen `Partitioned`, the NNX boxes the
  Trainer makes), `()` for a plain array."""
  return tuple(getattr(leaf, "names", ()) or ()) if _is_box(leaf) else ()


def _in_mesh_axes(leaf) -> bool:
  """Whether a leaf's annotation names mesh axes by its form: Linen `nn.with_partitioning`,
  or an NNX `PartitionSpec` (the Trainer boxes those as `nn.Partitioned`, logical names
  as `nn.LogicallyPartitioned`)."""
  import flax.linen as nn
  return isinstance(leaf, nn.Partitioned) and not isinstance(leaf, nn.LogicallyPartitioned)


def annotations(abstract_state: PyTree) -> list[tuple[str, tuple[int, ...], int, tuple, bool]]:
  """`(path, shape, bytes, names per dimension, names are mesh axes by their form)` of every
  leaf of a state; unannotated leaves have no names (`()`)."""
  out = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_state, is_leaf=_is_box):
    value = leaf.value if _is_box(leaf) else leaf
    shape = tuple(np.shape(value))
    dtype = np.dtype(getattr(value, "dtype", None) or np.asarray(value).dtype)
    out.append((keypath_str(path), shape, array_bytes(shape, dtype), _names_of(leaf),
                _in_mesh_axes(leaf)))
  return out


def mesh_specs(abstract_state: PyTree, rules: LogicalRules,
               mesh_axes: Sequence[str]) -> PyTree:
  """The mesh `PartitionSpec` of every leaf (`resolve`), a box's where the box was."""
  return jax.tree.map(lambda leaf: resolve(_names_of(leaf), rules, mesh_axes), abstract_state,
                      is_leaf=_is_box)


def resolve(names: tuple, rules: LogicalRules, mesh_axes: Sequence[str]) -> PartitionSpec:
  """The mesh `PartitionSpec` of one annotation (logical names through the rules, mesh axes
  as written, unknown names replicated: `check_layout` refuses those first)."""
  table = dict(rules)
  out = []
  for entry in names:
    axes = [a for name in axis_names(entry) for a in _axes_of(name, table, mesh_axes) or ()]
    out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  return PartitionSpec(*out)


def with_mesh_axes(rules: LogicalRules, mesh_axes: Sequence[str]) -> LogicalRules:
  """The table Flax's logical constraints read while tracing: `rules`, then each mesh axis
  no rule names as itself, so an annotation that names a mesh axis is constrained to it
  (Flax maps a name without a rule to None: replicated)."""
  named = {name for name, _ in rules}
  return tuple(rules) + tuple((axis, axis) for axis in mesh_axes if axis not in named)


def _fmt(params: list) -> str:
  shown = ", ".join(f"{path} {shape}" for path, shape in params[:4])
  return shown + (f" and {len(params) - 4} more" if len(params) > 4 else "")


def check_layout(abstract_state: PyTree, rules: LogicalRules, mesh_shape: Mapping[str, int],
                 batch_axes: Sequence[str], *, max_replicated_mb: float = 0) -> None:
  """Raises (or warns) for a rule table that would lay the parameters out other than meant.

  Args:
    abstract_state: the state with its annotations (`jax.eval_shape` of init).
    mesh_shape: mesh axis -> size.
    batch_axes: the mesh axes the batch is split over (the `batch` rule's).
    max_replicated_mb: a parameter larger than this (MiB) replicated over a mesh axis of
      size > 1 that does not split the batch is an error (0: no limit).

  Raises:
    ValueError: a name no rule maps and no mesh axis has (where the table shards
      parameters), two dimensions of one parameter on one mesh axis, a table whose
      parameter rules match no parameter, or a large parameter replicated over a
      model axis; each names the parameters, their shapes and the rule.
  """
  leaves = annotations(abstract_state)
  used = _check_names(leaves, rules, mesh_shape)
  _check_rules_match(used, rules)
  _check_divisible(leaves, rules, mesh_shape)
  _check_replicated(leaves, rules, mesh_shape, batch_axes, max_replicated_mb)


def _parameter_rules(rules: LogicalRules) -> list:
  """The rules that shard parameters: not the batch's, not the sequence's over `context` (an
  activation layout: context parallelism), not to None."""
  return [(n, t) for n, t in rules if n != BATCH and t is not None
          and not (n == "length" and t == "context")]


def _check_names(leaves: list, rules: LogicalRules, mesh_shape: Mapping[str, int]) -> set:
  """Raises for two dimensions of one parameter on one mesh axis, or a name no rule maps and
  no mesh axis has (where the layout shards parameters at all, or where the annotation names
  mesh axes by its form); returns the names used."""
  table = dict(rules)
  used, unknown, as_mesh_axes = set(), {}, False
  for path, shape, _, names, in_mesh_axes in leaves:
    seen: dict[str, str] = {}
    for entry in names:
      for name in axis_names(entry):
        used.add(name)
        axes = _axes_of(name, table, mesh_shape)
        if axes is None:
          unknown.setdefault(name, []).append((path, shape, in_mesh_axes))
          continue
        as_mesh_axes |= name not in table and bool(axes)
        for axis in axes:
          if axis in seen:
            raise ValueError(
                f"config.strategy.logical_axis_rules={rules!r} maps logical axes "
                f"{seen[axis]!r} and {name!r} of parameter {path!r} {shape} (annotated "
                f"{names}) to the same mesh axis {axis!r}; an array can use a mesh axis once. "
                f"Map one of them to another mesh axis or to None.")
          seen[axis] = name
  # A table that only splits the batch replicates logical names on purpose (plain data
  # parallelism), unless the layout splits parameters after all (mesh axes named in the
  # annotations): then an unknown name is as likely a misspelt mesh axis as a choice.
  sharded = bool(_parameter_rules(rules)) or as_mesh_axes
  unknown = {name: params for name, params in unknown.items()
             if sharded or any(mesh_form for _, _, mesh_form in params)}
  if unknown:
    name, params = next(iter(unknown.items()))
    rest = sorted(n for n in unknown if n != name)
    others = f" (unknown too: {rest})" if rest else ""
    raise ValueError(
        f"axis name {name!r} in the annotation of parameter(s) "
        f"{_fmt([(p, s) for p, s, _ in params])} is neither a logical axis of "
        f"config.strategy.logical_axis_rules={rules!r} nor a mesh axis (the mesh's axes: "
        f"{tuple(mesh_shape)}); Flax would replicate it silently. Correct a misspelt mesh "
        f"axis, add a rule ({name!r}, <mesh axis>), or ({name!r}, None) to replicate it on "
        f"purpose{others}.")
  return used


def _check_divisible(leaves: list, rules: LogicalRules, mesh_shape: Mapping[str, int]) -> None:
  """Raises for a parameter dimension that its mesh axes cannot split evenly (jax would raise
  `IndivisibleError` naming neither the parameter nor the rule)."""
  table, devices = dict(rules), math.prod(mesh_shape.values())
  for path, shape, _, names, _ in leaves:
    spec = resolve(names, rules, tuple(mesh_shape))
    for dim, (size, entry, names_here) in enumerate(zip(shape, spec, names, strict=False)):
      axes = axis_names(entry)
      pieces = math.prod(mesh_shape[a] for a in axes)
      if size % pieces == 0:
        continue
      by = [f"the rule {(n, table[n])!r}" if n in table else f"mesh axis {n!r} as annotated"
            for n in axis_names(names_here)]
      sizes = ", ".join(f"{a}={mesh_shape[a]}" for a in axes)
      fits = [d for d in range(1, devices + 1) if size % d == 0 and devices % d == 0]
      raise ValueError(
          f"parameter {path!r} {shape}: dimension {dim} of size {size} (annotated "
          f"{names_here!r}) is split over mesh axis {' x '.join(axes)} ({sizes}: {pieces} "
          f"pieces) by {' and '.join(by)} of config.strategy.logical_axis_rules, and "
          f"{pieces} does not divide {size}. Mesh sizes that divide it on "
          f"{devices} devices: {fits}; change config.strategy.mesh_shape so that "
          f"{' x '.join(axes)} is one of them, map "
          f"{axis_names(names_here)[0]!r} to another mesh axis, or to None (replicated).")


def _check_rules_match(used: set, rules: LogicalRules) -> None:
  """Raises if no parameter rule matches a parameter; warns for each one that does not."""
  parameter_rules = _parameter_rules(rules)
  dead = [(n, t) for n, t in parameter_rules if n not in used]
  if parameter_rules and len(dead) == len(parameter_rules):
    raise ValueError(
        f"config.strategy.logical_axis_rules: no parameter is sharded; the rule(s) "
        f"{', '.join(map(repr, dead))} match no logical axis of the model's parameters "
        f"(they are annotated with {sorted(used) or 'no logical axes'}), so every device "
        f"would hold the whole model. Name the model's logical axes in the rules, or drop "
        f"the rules for plain data parallelism.")
  if dead:
    warnings.warn(
        f"config.strategy.logical_axis_rules: the rule(s) {', '.join(map(repr, dead))} "
        f"match no parameter (the parameters are annotated with {sorted(used)}); they act "
        f"only on activations the model constrains with those names.", UserWarning,
        stacklevel=4)


def _check_replicated(leaves: list, rules: LogicalRules, mesh_shape: Mapping[str, int],
                      batch_axes: Sequence[str], max_replicated_mb: float) -> None:
  """Raises for a parameter above the limit replicated over a model axis."""
  model_axes = [a for a, n in mesh_shape.items() if n > 1 and a not in batch_axes]
  if not (max_replicated_mb and model_axes):
    return
  for path, shape, size, names, _ in leaves:
    spec = resolve(names, rules, tuple(mesh_shape))
    on = {a for entry in spec for a in axis_names(entry)}
    over = [a for a in model_axes if a not in on]
    if size > max_replicated_mb * 2**20 and over:
      annotated = f"annotated {names}" if names else "not annotated"
      raise ValueError(
          f"parameter {path!r} {shape} ({size / 2**20:.3g} MiB, {annotated}) is replicated "
          f"over model axis {over[0]!r} (size {mesh_shape[over[0]]}) "
          f"by config.strategy.logical_axis_rules={rules!r}, above "
          f"config.strategy.max_replicated_mb={max_replicated_mb:g}. Annotate it "
          f"and map a dimension to {over[0]!r}, or raise the limit (0: none).")
