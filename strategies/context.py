"""Context parallelism: every activation's sequence dimension split over a `context` mesh axis.

A mesh axis named `context` and the rule `("length", "context")` put each
device's share of every sequence on it: the models name the sequence dimension
of their activations `length`, so the embeddings, MLPs and norms work on the
shard as they are. Attention is the one computation that needs the other
shards' keys and values; it runs through `models.attention.attention`, which
reads the plan this module keeps (`current()`) and uses one of two methods
(`config.strategy.context.method`):

- `all_gather`: the keys and values are gathered over `context` inside attention,
  the queries stay local.
- `ring`: each device keeps its block of queries; the key/value blocks move one
  device on per step (a collective permute), each step's scores are combined with a
  running log-sum-exp, and a block (or, in the load-balanced order, a chunk pair)
  whose scores a causal mask covers entirely is skipped. No device holds a whole
  sequence's keys.

With `load_balance` (the default) the sequence is held in a load-balanced causal
order: it is cut into `2 x context` chunks and device `i` holds chunks `i` and
`2 x context - 1 - i`, so causal attention's work is the same on every device. The
batch is put in that order once, before the model, and the model's outputs are put
back in sequence order before the loss (`in_layout`). Without it each device holds
one consecutive block: under a causal mask device `i` of the ring computes `i + 1`
blocks, and all-gather's devices compute unequal shares.

The strategy checks the layout (`from_mesh`), sets the plan while it traces
(`active`), and refuses a step whose model never called the shared attention
(`requiring_attention`): its attention would see only the local shard's keys, or
the partitioner would gather whole sequences silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from strategies.tracing import Steering

PyTree = Any

#: The mesh axis a sequence is split over, and the logical name of the sequence dimension.
CONTEXT_AXIS = "context"
LENGTH = "length"
METHODS = ("all_gather", "ring")
#: `config.strategy.context`'s fields and their defaults.
DEFAULTS = {"method": "all_gather", "load_balance": True}


class ContextError(ValueError):
  """A context-parallel layout, config or model that cannot work."""


@dataclasses.dataclass(frozen=True)
class ContextPlan:
  """How attention runs over the `context` axis (`models.attention` reads it).

  Attributes:
    size: the `context` axis's devices.
    method: `all_gather` or `ring`.
    load_balance: whether the sequence is held in the load-balanced causal order.
    batch_axes: the mesh axes the batch is split over.
    heads_axes: the mesh axes the `heads` name is split over (tensor parallelism).
    kv_heads_axes: the mesh axes `kv_heads` is split over.
  """

  size: int
  method: str
  load_balance: bool
  batch_axes: tuple[str, ...] = ()
  heads_axes: tuple[str, ...] = ()
  kv_heads_axes: tuple[str, ...] = ()
  axis: str = CONTEXT_AXIS

  @property
  def chunks(self) -> int:
    """The pieces a sequence is cut into: `2 x size` load-balanced, else `size`."""
    return 2 * self.size if self.load_balance else self.size

  def check_length(self, length: int) -> None:
    """Raises unless a sequence of `length` tokens splits into this layout's chunks."""
    if length % self.chunks:
      what = (f"2 x context = {self.chunks} equal chunks (the load-balanced causal order: "
              f"each device holds an early and a late chunk)" if self.load_balance else
              f"context = {self.chunks} equal blocks")
      fits = [self.chunks * k for k in range(1, 5)]
      raise ContextError(
          f"the batch's sequence length {length} (the length of its rows) does not split "
          f"into {what} over "
          f"the {self.axis!r} mesh axis ({self.axis}={self.size}, "
          f"config.strategy.context.method={self.method!r}); use a length that is a multiple "
          f"of {self.chunks} (e.g. {fits}), or another context size.")

  def order(self, length: int) -> np.ndarray:
    """The sequence position held at each index of the layout: `arange(length)`, or the
    load-balanced order (device `i`'s indices hold chunks `i` and `2C - 1 - i`)."""
    self.check_length(length)
    if not self.load_balance:
      return np.arange(length)
    chunk = length // self.chunks
    pieces = np.arange(length).reshape(self.chunks, chunk)
    order = [pieces[j] for i in range(self.size) for j in (i, self.chunks - 1 - i)]
    return np.concatenate(order)

  def describe(self) -> str:
    order = "load-balanced causal order" if self.load_balance else "sequence order"
    return (f"context parallel over {self.axis!r} ({self.axis}={self.size}): attention by "
            f"{self.method}, {order}")


def config_fields(config) -> dict:
  """`config.strategy.context` as keyword arguments of `from_mesh`."""
  fields = config.strategy.context
  return {"method": fields.method, "load_balance": fields.load_balance}


def check_unused(config) -> None:
  """Raises if an ensemble strategy (a sweep) is given a `context` axis or context fields:
  its members split the devices between them and each holds whole sequences.

  Raises:
    ContextError: naming the field, the strategy and the one that splits sequences.
  """
  name = config.strategy.name
  where = None
  if CONTEXT_AXIS in tuple(config.strategy.mesh_axes):
    where = f"config.strategy.mesh_axes={tuple(config.strategy.mesh_axes)}"
  for field, value in config_fields(config).items():
    if value != DEFAULTS[field]:
      where = where or f"config.strategy.context.{field}={value!r}"
  if where:
    raise ContextError(
        f"{where} asks for context parallelism, but config.strategy.name={name!r} trains an "
        f"ensemble, whose members split the devices between them and each hold whole "
        f"sequences. Context parallelism runs under 'sharded_data_parallel' with a "
        f"{CONTEXT_AXIS!r} mesh axis and the rule ({LENGTH!r}, {CONTEXT_AXIS!r}).")


def _axes(target) -> tuple[str, ...]:
  if target is None:
    return ()
  return (target,) if isinstance(target, str) else tuple(target)


def from_mesh(mesh_shape: dict[str, int], rules, batch_axes: tuple[str, ...],
              axis_types: str, *, pipelined: bool, method: str = "all_gather",
              load_balance: bool = True) -> ContextPlan | None:
  """The context plan of a mesh with a `context` axis (None without one), checked.

  Raises:
    ContextError: context fields without a `context` axis, a rule table that does not put
      `length` (and only it) on `context`, an unknown method, explicit axis types, or a
      pipeline on the same mesh.
  """
  if method not in METHODS:
    raise ContextError(f"config.strategy.context.method={method!r} is not one of {METHODS}.")
  if load_balance not in (True, False):
    raise ContextError(f"config.strategy.context.load_balance={load_balance!r} must be "
                       f"True or False.")
  table = dict(rules)
  if CONTEXT_AXIS not in mesh_shape:
    if CONTEXT_AXIS in _axes(table.get(LENGTH)):
      raise ContextError(f"config.strategy.logical_axis_rules maps {LENGTH!r} to "
                         f"{CONTEXT_AXIS!r}, but the mesh axes {tuple(mesh_shape)} have none.")
    fields = {"method": method, "load_balance": load_balance}
    for name, value in fields.items():
      if value != DEFAULTS[name]:
        raise ContextError(
            f"config.strategy.context.{name}={value!r} is set, but the mesh axes "
            f"{tuple(mesh_shape)} have no {CONTEXT_AXIS!r} axis to split sequences over: add "
            f"one (e.g. mesh_axes=('data', 'context')) with the rule ({LENGTH!r}, "
            f"{CONTEXT_AXIS!r}), or leave it at {DEFAULTS[name]!r}.")
    return None
  if _axes(table.get(LENGTH)) != (CONTEXT_AXIS,):
    raise ContextError(
        f"the mesh has a {CONTEXT_AXIS!r} axis, but config.strategy.logical_axis_rules maps "
        f"{LENGTH!r} to {table.get(LENGTH)!r}: add the rule ({LENGTH!r}, {CONTEXT_AXIS!r}) "
        f"so each device holds its share of every sequence.")
  others = [name for name, target in rules
            if name != LENGTH and CONTEXT_AXIS in _axes(target)]
  if others:
    raise ContextError(
        f"config.strategy.logical_axis_rules maps {others} to the {CONTEXT_AXIS!r} axis, "
        f"which only the sequence ({LENGTH!r}) may use; lay the weights out over the other "
        f"axes (an FSDP rule such as ('embed', 'data')).")
  if axis_types != "auto":
    raise ContextError(
        f"config.strategy.axis_types={axis_types!r}: context parallelism runs under 'auto' "
        f"axis types only.")
  if pipelined:
    raise ContextError(
        f"the mesh has both a 'stage' and a {CONTEXT_AXIS!r} axis: a pipeline with context "
        f"parallelism is not supported; use one of them (packed sequences run under both).")
  return ContextPlan(size=mesh_shape[CONTEXT_AXIS], method=method,
                     load_balance=bool(load_balance), batch_axes=tuple(batch_axes),
                     heads_axes=_axes(table.get("heads")),
                     kv_heads_axes=_axes(table.get("kv_heads")))


#: The context plan a strategy sets while tracing; the attention calls traced under it.
STEERING = Steering("context")  # Its plan: a `ContextPlan`.
#: The context plan a strategy set for the step being traced, or None.
current = STEERING.current
#: Attention traced inside runs by the given plan (None: plain attention).
active = STEERING.active
#: Called by the shared attention each time it is traced (`requiring_attention` counts).
record_call = STEERING.record


def requiring_attention(plan: ContextPlan, fn: Callable) -> Callable:
  """`fn` (a step), raising while it is traced if the model never called the shared attention.

  Every other layer works on its sequence shard as it is; attention written by hand
  would see only its own shard's keys (or the partitioner would gather the sequence
  silently), so a model under a `context` axis must attend through
  `models.attention.attention`.
  """
  return STEERING.requiring(fn, lambda: ContextError(
      f"the mesh has a {CONTEXT_AXIS!r} axis ({plan.axis}={plan.size}), but the model "
      f"never called models.attention.attention: attention written by hand (or "
      f"nn.dot_product_attention, jax.nn.dot_product_attention) would not see the other "
      f"devices' keys and values. Call models.attention.attention(q, k, v, ...) for the "
      f"model's attention, or train without a {CONTEXT_AXIS!r} axis."))


def _sequence_length(tree: PyTree) -> int | None:
  lengths = [np.shape(x)[1] for x in jax.tree.leaves(tree) if np.ndim(x) >= 2]
  return max(lengths) if lengths else None


def _moves(size: int, inverse: bool) -> dict[tuple[int, int], list[tuple[int, int]]]:
  """The chunk moves between sequence order (device `d` holds chunks `2d`, `2d + 1`) and the
  load-balanced order (device `i` holds chunks `i`, `2 x size - 1 - i`), grouped by (source
  slot, destination slot) into device pairs: each group is one collective permute."""
  groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
  for c in range(2 * size):
    plain = (c // 2, c % 2)
    balanced = (c, 0) if c < size else (2 * size - 1 - c, 1)
    (src, src_slot), (dst, dst_slot) = (balanced, plain) if inverse else (plain, balanced)
    groups.setdefault((src_slot, dst_slot), []).append((src, dst))
  return groups


def _reorder(plan: ContextPlan, x: jax.Array, inverse: bool) -> jax.Array:
  """`x [batch, length, ...]` between sequence order and the load-balanced order: each
  device sends its two chunks where they go (collective permutes of one chunk each), so
  no device holds more than its share of `x`."""
  groups = _moves(plan.size, inverse)

  def move(local):
    chunks = jnp.split(local, 2, axis=1)
    out = [jnp.zeros_like(chunks[0]), jnp.zeros_like(chunks[1])]
    for (src_slot, dst_slot), pairs in groups.items():
      out[dst_slot] = out[dst_slot] + jax.lax.ppermute(chunks[src_slot], plan.axis, pairs)
    return jnp.concatenate(out, axis=1)

  spec = jax.sharding.PartitionSpec(None, plan.axis)
  return jax.shard_map(move, in_specs=spec, out_specs=spec, axis_names={plan.axis},
                       check_vma=False)(x)


def _permute(plan: ContextPlan, tree: PyTree, length: int, inverse: bool) -> PyTree:
  plan.check_length(length)
  return jax.tree.map(lambda x: _reorder(plan, x, inverse)
                      if np.ndim(x) >= 2 and np.shape(x)[1] == length else x, tree)


def in_layout(plan: ContextPlan | None, apply: Callable[..., tuple[Any, PyTree]]
              ) -> Callable[..., tuple[Any, PyTree]]:
  """`apply(params, model_state, batch, ...) -> (outputs, model_state)` with the batch put in
  the plan's order and the outputs put back in sequence order: the identity unless the
  plan holds sequences in the load-balanced order.

  The batch's arrays whose second dimension is the sequence (the longest second
  dimension among them) are reordered; so are the outputs' of that length.
  """
  if plan is None or not plan.load_balance:
    return apply

  def reordered(params, model_state, batch, *args, **kwargs):
    length = _sequence_length(batch)
    if length is None:
      return apply(params, model_state, batch, *args, **kwargs)
    outputs, model_state = apply(params, model_state, _permute(plan, batch, length, False),
                                 *args, **kwargs)
    return _permute(plan, outputs, length, True), model_state

  return reordered
