"""Pipeline parallelism: a model's stacked layers split into stages over the `stage` mesh axis.

A model marks its repeated layers once with a layer stack (`models.layer_stack`:
`LayerStack` for Linen, `NnxLayerStack` for NNX): their parameters are one tree
with a leading `layer` axis. Under every strategy without a `stage` mesh axis the
stack is a scan over that axis. Under `sharded_data_parallel` with a `stage` axis
(and the rule `("layer", "stage")`), the strategy makes a `Pipeline` current
while it traces, and the stack runs `Pipeline.run` instead:

- the layers are cut into `stages * repeats` groups of consecutive layers; stage
  `s` holds groups `s, s + S, s + 2S, ...` (one group each for GPipe, `repeats`
  for the circular schedule);
- the batch is cut into `microbatches` (microbatch `m` takes rows `m, m + M, ...`,
  so each data shard feeds every microbatch);
- each iteration every stage runs its current group on its current microbatch
  (a `vmap` over the stage dimension, laid out over the `stage` axis), then the
  activations move one stage on (a collective permute). A microbatch leaving the
  last stage re-enters the first for its next repeat, until the last.

Autodiff of that loop is GPipe's backward. With `remat`, each stage keeps only
its input per iteration and recomputes its layers in the backward pass, so the
activations held per stage are one layer-boundary tensor per iteration instead
of every layer's intermediates.

Randomness: layer `l` on microbatch `m` draws from its own key with `m` folded in,
whatever the stages, so a pipelined run equals the same microbatches run one
after another on one device (a pipeline of one stage).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from strategies.tracing import Steering

PyTree = Any
#: The mesh axis stages are laid out over, and the logical name of the stacked layer axis.
STAGE_AXIS = "stage"
LAYER = "layer"

#: The pipeline a strategy sets while tracing; the layer stacks it ran (`requiring_stack`).
STEERING = Steering("pipeline")  # Its plan: a `Pipeline`.


class PipelineError(ValueError):
  """A model or batch the chosen pipeline cannot run, found before compiling."""


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """How a layer stack runs over stages.

  Attributes:
    stages: pipeline stages (the `stage` mesh axis' size; 1: the microbatches run one
      after another on every device, the reference a pipeline equals).
    microbatches: how many pieces the batch is cut into; at least `stages`.
    repeats: layer groups per stage: 1 is GPipe, more is the circular schedule.
    remat: recompute each stage's layers in the backward pass (keep only its inputs).
    axis: the mesh axis of the stages (None when `stages` is 1).
    batch_axes: the mesh axes the batch is split over (microbatches keep that layout).
    data_shards: how many pieces those axes cut the batch into.
  """

  stages: int
  microbatches: int
  repeats: int = 1
  remat: bool = False
  axis: str | None = STAGE_AXIS
  batch_axes: tuple[str, ...] = ()
  data_shards: int = 1

  def __post_init__(self):
    for name, low in (("stages", 1), ("microbatches", 1), ("repeats", 1)):
      value = getattr(self, name)
      if not isinstance(value, int) or value < low:
        raise PipelineError(f"config.strategy.pipeline.{name}={value!r} must be an integer "
                            f">= {low}.")
    if self.microbatches < self.stages:
      raise PipelineError(
          f"config.strategy.pipeline.microbatches={self.microbatches} is fewer than the "
          f"{self.stages} stages of the mesh's {self.axis!r} axis: every stage would idle in "
          f"every iteration. Use at least {self.stages} (4 x stages keeps the bubble "
          f"under 20%).")

  @property
  def schedule(self) -> str:
    return "gpipe" if self.repeats == 1 else "circular"

  @property
  def iterations(self) -> int:
    """Loop iterations of one forward pass: every microbatch through every repeat, plus the
    fill (and drain) of `stages - 1`."""
    return self.microbatches * self.repeats + self.stages - 1

  @property
  def bubble_fraction(self) -> float:
    """The share of stage-iterations that idle: `(S - 1) / (M * R + S - 1)` ((S-1)/(M+S-1)
    for GPipe; a circular schedule's is smaller by about its repeats)."""
    return (self.stages - 1) / self.iterations

  def check_layers(self, num_layers: int, where: str = "the layer stack") -> int:
    """Layers per group; raises unless `num_layers` splits into stages x repeats groups."""
    groups = self.stages * self.repeats
    if num_layers % groups:
      raise PipelineError(
          f"{where} has {num_layers} layers, which do not split into {self.stages} stages x "
          f"{self.repeats} repeats (config.strategy.pipeline.repeats) = {groups} equal "
          f"groups; use a layer count divisible by {groups}, or other stages or repeats.")
    return num_layers // groups

  def check_batch(self, batch_size: int, data_shards: int = 1) -> int:
    """Rows per microbatch; raises unless the batch cuts into microbatches that split over
    the data shards."""
    per = batch_size // self.microbatches
    if batch_size % self.microbatches or per % data_shards:
      raise PipelineError(
          f"a batch of {batch_size} rows does not cut into "
          f"config.strategy.pipeline.microbatches={self.microbatches} microbatches of a "
          f"multiple of the {data_shards} data shard(s): the batch (per accumulation step) "
          f"must be a multiple of {self.microbatches * data_shards}.")
    return per

  def stage_layers(self, num_layers: int) -> list[list[range]]:
    """For each stage, its groups' layer ranges, in the order it runs them."""
    per = self.check_layers(num_layers)
    return [[range((r * self.stages + s) * per, (r * self.stages + s + 1) * per)
             for r in range(self.repeats)] for s in range(self.stages)]

  def check_state(self, abstract_state: PyTree) -> int:
    """The stack's layer count, from the parameters whose leading axis is named `layer`.

    Raises:
      PipelineError: no parameter has that axis (the model has no layer stack), the
        stacked parameters disagree on it, or it does not split into the stages.
    """
    counts = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(
        getattr(abstract_state, "params", abstract_state), is_leaf=_is_box):
      names = getattr(leaf, "names", None) or ()
      if names and names[0] == LAYER:
        counts[jax.tree_util.keystr(path)] = leaf.value.shape[0]
    if not counts:
      raise PipelineError(
          f"the mesh has a {self.axis!r} axis, but no parameter has a leading {LAYER!r} axis: "
          f"the model has no layer stack to pipeline. Wrap its repeated block in "
          f"models.layer_stack.LayerStack (Linen) or NnxLayerStack (NNX), or remove the "
          f"{self.axis!r} axis from config.strategy.mesh_axes.")
    if len(set(counts.values())) > 1:
      raise PipelineError(f"the parameters named {LAYER!r} disagree on the layer count: "
                          f"{counts}; a pipelined model has one layer stack.")
    num_layers = next(iter(counts.values()))
    self.check_layers(num_layers)
    return num_layers

  def layout_lines(self, num_layers: int) -> list[str]:
    """Which layers each stage runs, one line a stage."""
    def span(r: range) -> str:
      return f"{r.start}" if len(r) == 1 else f"{r.start}-{r.stop - 1}"
    return [f"stage {s}: layers " + ", ".join(span(r) for r in groups)
            for s, groups in enumerate(self.stage_layers(num_layers))]

  def describe(self) -> str:
    return (f"pipeline: {self.stages} stage(s) over {self.axis!r}, {self.schedule} schedule, "
            f"{self.microbatches} microbatches, {self.repeats} repeat(s), bubble "
            f"{self.bubble_fraction:.1%}{', stages rematerialised' if self.remat else ''}")

  # -- The schedule ----------------------------------------------------------------------

  def _constrain(self, x: jax.Array, *entries) -> jax.Array:
    """`x` laid out with the given leading entries, the rest left to the partitioner."""
    if self.axis is None and not self.batch_axes:
      return x
    spec = PartitionSpec(*entries, *([PartitionSpec.UNCONSTRAINED] * (x.ndim - len(entries))))
    return jax.lax.with_sharding_constraint(x, spec)

  def run(self, layer_fn: Callable[[PyTree, PyTree, jax.Array], PyTree],
          stacked: PyTree, x: PyTree) -> PyTree:
    """`x` through every layer of `stacked`, pipelined.

    Args:
      layer_fn: `(one layer's slice of stacked, activations, microbatch index) ->
        activations`; a layer that draws randomness folds the microbatch index into its
        own key (`models.layer_stack`), so the draws do not depend on the stages.
      stacked: arrays with a leading layer axis (parameters, per-layer keys).
      x: activations with a leading batch axis (a pytree).
    """
    S, M, R = self.stages, self.microbatches, self.repeats
    STEERING.record(self)
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    per = self.check_layers(num_layers)
    batch = jax.tree.leaves(x)[0].shape[0]
    rows = self.check_batch(batch, self.data_shards)
    batch_entry = self.batch_axes or None
    stage_entry = self.axis if S > 1 else None

    # [L, ...] -> [S, R, K, ...]: stage s, repeat r holds layers (r * S + s) * K + k.
    def by_stage(p):
      p = jnp.swapaxes(p.reshape(R, S, per, *p.shape[1:]), 0, 1)
      return self._constrain(p, stage_entry)
    weights = jax.tree.map(by_stage, stacked)

    # [B, ...] -> [M, B / M, ...]: microbatch m takes rows m, m + M, ...
    def micro(a):
      a = jnp.swapaxes(a.reshape(rows, M, *a.shape[1:]), 0, 1)
      return self._constrain(a, None, batch_entry)
    buffer = jax.tree.map(micro, x)
    state = jax.tree.map(lambda a: self._constrain(jnp.zeros((S, *a.shape[1:]), a.dtype),
                                                   stage_entry, batch_entry), buffer)

    def stage_fn(w, h, r, m):
      """One stage runs its group of repeat `r` on microbatch `m`'s activations `h`."""
      if R == 1:  # GPipe: the one group, no per-iteration gather (nor a saved copy of it).
        group = jax.tree.map(lambda a: a[0], w)
      else:
        group = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False),
                             w)
      h, _ = jax.lax.scan(lambda h, p: (layer_fn(p, h, m), None), h, group)
      return h

    if self.remat:
      stage_fn = jax.checkpoint(stage_fn)
    stages = jax.vmap(stage_fn, spmd_axis_name=stage_entry)
    stage_ids = jnp.arange(S)

    def iteration(carry, t):
      state, buffer = carry
      # The first stage takes item t: microbatch t mod M (its repeat t // M) from the buffer.
      first = jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, t % M, 0), buffer)
      state = jax.tree.map(lambda a, f: a.at[0:1].set(f), state, first)
      item = t - stage_ids
      repeat = jnp.clip(item // M, 0, R - 1)
      out = stages(weights, state, repeat, jnp.where(item >= 0, item % M, 0))
      out = jax.tree.map(lambda a: self._constrain(a, stage_entry, batch_entry), out)
      # The last stage's item back into the buffer: the next repeat's input, or the output.
      done = t - (S - 1)
      valid = (done >= 0) & (done < M * R)
      slot = jnp.where(valid, done % M, 0)

      def write(b, o):
        current = jax.lax.dynamic_index_in_dim(b, slot, 0)
        return jax.lax.dynamic_update_index_in_dim(
            b, jnp.where(valid, o[S - 1:S], current), slot, 0)
      buffer = jax.tree.map(write, buffer, out)
      # Stage s + 1 takes what stage s made (a collective permute over the stage axis).
      state = jax.tree.map(lambda a: self._constrain(jnp.roll(a, 1, axis=0), stage_entry,
                                                     batch_entry), out)
      return (state, buffer), None

    (_, buffer), _ = jax.lax.scan(iteration, (state, buffer), jnp.arange(self.iterations))
    return jax.tree.map(
        lambda a: jnp.swapaxes(a, 0, 1).reshape(batch, *a.shape[2:]), buffer)


def _is_box(x) -> bool:
  return hasattr(x, "names") and hasattr(x, "value")


#: `config.strategy.pipeline`'s fields and their defaults (no pipeline settings).
DEFAULTS = {"microbatches": 0, "repeats": 1, "remat": False}


def config_fields(config) -> dict:
  """`config.strategy.pipeline` as keyword arguments of `from_mesh`."""
  fields = config.strategy.pipeline
  return {"microbatches": fields.microbatches, "repeats": fields.repeats,
          "remat": fields.remat}


def check_unused(config) -> None:
  """Raises if `config.strategy.pipeline` is set for an ensemble strategy (a sweep): its
  members split the devices between them, and a member's layers are not pipelined. (The
  other one-model strategies run the stack as a scan, as the reference a pipeline equals.)

  Raises:
    PipelineError: naming the field, the strategy and the one that pipelines.
  """
  for name, value in config_fields(config).items():
    if value != DEFAULTS[name]:
      raise PipelineError(
          f"config.strategy.pipeline.{name}={value!r} is set, but "
          f"config.strategy.name={config.strategy.name!r} trains an ensemble, whose members "
          f"split the devices between them: a member's layers are not pipelined over "
          f"stages. Pipelines run under 'sharded_data_parallel' with a {STAGE_AXIS!r} mesh "
          f"axis; leave it at {DEFAULTS[name]!r} for an ensemble or sweep.")


def from_mesh(mesh_shape: dict[str, int], rules, batch_axes: tuple[str, ...],
              axis_types: str, *, microbatches: int = 0, repeats: int = 1,
              remat: bool = False) -> Pipeline | None:
  """The pipeline of a mesh with a `stage` axis (None without one), checked against the rules.

  Raises:
    PipelineError: pipeline fields without a `stage` axis, a rule table that does not
      put `layer` on `stage` or puts anything else there, explicit axis types, or bad
      fields.
  """
  if STAGE_AXIS not in mesh_shape:
    fields = {"microbatches": microbatches, "repeats": repeats, "remat": remat}
    for name, value in fields.items():
      if value != DEFAULTS[name]:
        raise PipelineError(
            f"config.strategy.pipeline.{name}={value!r} is set, but the mesh axes "
            f"{tuple(mesh_shape)} have no {STAGE_AXIS!r} axis to pipeline over: add one "
            f"(e.g. mesh_axes=('data', 'stage')) with the rule ('layer', 'stage'), or leave "
            f"it at {DEFAULTS[name]!r}.")
    return None
  table = dict(rules)
  if table.get(LAYER) != STAGE_AXIS:
    raise PipelineError(
        f"the mesh has a {STAGE_AXIS!r} axis, but config.strategy.logical_axis_rules maps "
        f"{LAYER!r} to {table.get(LAYER)!r}: add the rule ({LAYER!r}, {STAGE_AXIS!r}) so "
        f"each stage holds its own layers.")
  others = [name for name, target in rules if name != LAYER and target is not None and
            STAGE_AXIS in ((target,) if isinstance(target, str) else tuple(target))]
  if others:
    raise PipelineError(
        f"config.strategy.logical_axis_rules maps {others} to the {STAGE_AXIS!r} axis, which "
        f"only the layer stack's {LAYER!r} axis may use (the batch and the other weights "
        f"are laid out over the other axes).")
  if axis_types != "auto":
    raise PipelineError(
        f"config.strategy.axis_types={axis_types!r}: the pipeline runs under 'auto' axis "
        f"types only (its schedule's layouts are constraints the partitioner propagates).")
  stages = mesh_shape[STAGE_AXIS]
  return Pipeline(stages=stages, microbatches=microbatches or stages, repeats=repeats,
                  remat=bool(remat), axis=STAGE_AXIS if stages > 1 else None,
                  batch_axes=tuple(batch_axes),
                  data_shards=math.prod(mesh_shape[a] for a in batch_axes))


def requiring_stack(pipeline: Pipeline, fn: Callable) -> Callable:
  """`fn` (a step), raising while it is traced if it pipelines no layer stack.

  A model whose layers carry the `layer` name from its own `nn.scan` or loop passes the
  parameter check, but nothing would be pipelined: its layers would only be stored by
  stage and gathered for every use.
  """
  return STEERING.requiring(fn, lambda: PipelineError(
      f"the mesh has a {pipeline.axis or STAGE_AXIS!r} axis, but the step ran no layer "
      f"stack: parameters named {LAYER!r} by the model's own nn.scan (or a loop) are "
      f"not pipelined. Mark the repeated layers with models.layer_stack.LayerStack "
      f"(Linen) or NnxLayerStack (NNX)."))


#: The pipeline a strategy set for the step being traced, or None.
current = STEERING.current
#: Layer stacks traced inside run the given pipeline (None: as a scan).
active = STEERING.active

