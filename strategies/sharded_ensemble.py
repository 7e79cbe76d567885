"""Ensembles under `jax.jit`: members stacked on a leading axis, sharded over a mesh.

The member axis is split over the mesh axis `ensemble`; a second mesh axis,
`data`, splits each member's batch (data parallelism inside every member).
Any member count that divides over the `ensemble` axis works: one member per
device, several per device (16 members on 8 devices, 4 on one device), or all
on one. The members that share a device run either vectorised (`vmap`) or
one after another (unrolled into the program, or a `lax.map` loop), chosen by
`config.strategy.ensemble_loop`.

A frozen part identical in every member (a LoRA base loaded from one model, a `copy`
reference, a distillation teacher: `trainer.run.shared` decides) is held once: its leaves
have no member axis and are replicated over the mesh, as a single data-parallel run holds
them, and every member's step reads that one copy and leaves it as it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from strategies.base import InitFn, PyTree, StepFn, Strategy, init_compiler_options
from strategies.capabilities import Ensemble, ensemble_size, sweep_seeds
from strategies.mesh import BATCH_AXIS, GlobalMeshBatch
from strategies.registry import register
from strategies.tree import keypath_str

ENSEMBLE, DATA = "ensemble", BATCH_AXIS  # DATA: BatchNorm(axis_name="batch") reduces over it.
MEMBERS = "members"  # The vmap axis over the members that share a device.
LOOPS = ("unroll", "map", "vmap")


def held_once(x) -> bool:
  """Whether a placed ensemble state's leaf is held once (no member axis, `share`)."""
  spec = getattr(getattr(x, "sharding", None), "spec", (ENSEMBLE,))
  return not (len(spec) and spec[0] == ENSEMBLE)


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
    self._shared_sharding = NamedSharding(self.mesh, PartitionSpec())
    self._batch_sharding = NamedSharding(self.mesh, PartitionSpec(DATA))
    self._member_batches = NamedSharding(self.mesh, PartitionSpec(ENSEMBLE, DATA))
    #: `state path -> held once`, the paths `/`-joined (`params/blocks/attn/kernel`); set
    #: by `share` before a state is made or restored. None: every leaf is per member.
    self.shared: Callable[[str], bool] | None = None

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> ShardedEnsemble:
    strategy = cls(num_members=ensemble_size(config, jax.device_count()),
                   mesh_shape=config.strategy.ensemble_mesh_shape,
                   loop=config.strategy.ensemble_loop)
    strategy.member_seeds = sweep_seeds(config)
    data = config.data if "data" in config else {}
    if "member_sources" in data and len(data.member_sources):
      strategy.read_own_batches(len(config.data.member_sources))
    return strategy

  def read_own_batches(self, count: int) -> None:
    """Each member reads its own rows: a host batch is `[members, rows, ...]`, the members
    split over `ensemble` as their states are, each member's rows over `data`
    (`config.data.member_sources`, `count` entries).

    Raises:
      ValueError: `count` is not the member count, or the run spans processes.
    """
    if count != self.num_members:
      raise ValueError(f"config.data.member_sources has {count} entries for the "
                       f"{self.num_members} members; give one tuple of sources per member.")
    if jax.process_count() > 1:
      raise ValueError("config.data.member_sources (each member its own data) runs in one "
                       "process; a run of several processes gives every member the same "
                       "batch.")
    self.batch_models = self.num_members

  @property
  def num_data_replicas(self) -> int:
    return self.mesh.shape[DATA]

  # -- Placement -----------------------------------------------------------------

  def share(self, shared: Callable[[str], bool] | None) -> None:
    """Holds the state leaves whose paths `shared` accepts once, for every member."""
    self.shared = shared

  def member_mask(self, tree: PyTree) -> PyTree:
    """Per leaf of a state (or an abstract one): whether it has the member axis."""
    if self.shared is None:
      return jax.tree.map(lambda _: True, tree)
    return jax.tree_util.tree_map_with_path(
        lambda p, _: not self.shared(keypath_str(p, drop_box=True)), tree)

  def _over_local_members(self, fn: StepFn, loop: str, mask: PyTree = None,
                          returns_state: bool = False, batch_axis: int = 0) -> StepFn:
    """`fn(member_state, *inputs)` applied to each member a device holds (the same inputs;
    where each member reads its own batch, `batch_models`, the first input is the local
    members' batches, member j's at index j of axis `batch_axis`).

    `mask` (`member_mask` of the state): the leaves without it are one copy, which every
    member reads; with `returns_state`, the new state's are that copy, unchanged."""
    if self.batch_models:
      return self._with_own_batches(fn, loop, mask, returns_state, batch_axis)
    return self._over(fn, loop, mask, returns_state)

  def _over(self, fn: StepFn, loop: str, mask: PyTree, returns_state: bool) -> StepFn:
    """`_over_local_members` where every member reads the same inputs."""
    leaves = jax.tree.leaves(mask) if mask is not None else []
    if all(leaves):
      stepped = self._over_members(fn, loop)
    else:
      stepped = self._over_members_sharing(fn, loop, mask)
    if all(leaves) or not returns_state:
      return stepped

    def keeping_shared(state, *inputs):
      new, *rest = stepped(state, *inputs)
      new = jax.tree.map(lambda m, y, x: y if m else x, mask, new, state)
      return (new, *rest)

    return keeping_shared

  def _with_own_batches(self, fn: StepFn, loop: str, mask: PyTree, returns_state: bool,
                        batch_axis: int) -> StepFn:
    """`_over_local_members` where each member reads its own batch: the member's batch goes
    in with its state, as one more leaf per member."""
    def own_batches(state, batch, *rest):
      batch = jax.tree.map(lambda x: jnp.moveaxis(x, batch_axis, 0), batch)
      both = (jax.tree.map(lambda _: True, state) if mask is None else mask,
              jax.tree.map(lambda _: True, batch))
      stepped = self._over(lambda sb, *r: fn(sb[0], sb[1], *r), loop, both, False)
      out = stepped((state, batch), *rest)
      if not returns_state or mask is None:
        return out
      new, *others = out
      return (jax.tree.map(lambda m, y, x: y if m else x, mask, new, state), *others)

    return own_batches

  def _over_members(self, fn: StepFn, loop: str) -> StepFn:
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

  def _over_members_sharing(self, fn: StepFn, loop: str, mask: PyTree) -> StepFn:
    """`_over_members` where the leaves `mask` marks False are one copy for all members."""
    if loop == "vmap":
      axes = jax.tree.map(lambda m: 0 if m else None, mask)
      return lambda state, *inputs: jax.vmap(
          fn, in_axes=(axes,) + (None,) * len(inputs), axis_name=MEMBERS)(state, *inputs)
    if loop == "map":
      def mapped(state, *inputs):
        own = jax.tree.map(lambda m, x: x if m else None, mask, state)
        def one(s):
          return fn(jax.tree.map(lambda m, x, y: x if m else y, mask, s, state), *inputs)
        return jax.lax.map(one, own)
      return mapped

    def unrolled(state, *inputs):
      outs = [fn(jax.tree.map(lambda m, x, i=i: x[i] if m else x, mask, state), *inputs)
              for i in range(self.members_per_device)]
      return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)

    return unrolled

  def put_batch(self, batch: PyTree) -> PyTree:
    if not self.batch_models:
      return super().put_batch(batch)
    return jax.device_put(batch, self._member_batches)

  def put_batches(self, batches: PyTree) -> PyTree:
    if not self.batch_models:
      return super().put_batches(batches)
    return jax.device_put(batches, NamedSharding(self.mesh, self._batch_spec(steps=True)))

  def _batch_spec(self, steps: bool = False) -> PartitionSpec:
    """The batch's spec in a step: each member's rows (`batch_models`), or rows all read."""
    spec = (ENSEMBLE, DATA) if self.batch_models else (DATA,)
    return PartitionSpec(*((None,) if steps else ()), *spec)

  def _specs(self, state: PyTree) -> PyTree:
    return jax.tree.map(lambda m: PartitionSpec(ENSEMBLE) if m else PartitionSpec(),
                        self.member_mask(state))

  def _shardings(self, state: PyTree) -> PyTree:
    return jax.tree.map(lambda m: self._member_sharding if m else self._shared_sharding,
                        self.member_mask(state))

  def create_state(self, init_fn: InitFn, rng: jax.Array) -> PyTree:
    rngs = self.member_rngs(rng)
    init = (jax.vmap(init_fn) if self.loop == "vmap"
            else lambda r: jax.lax.map(init_fn, r))
    options = init_compiler_options(self.mesh.devices.flat)
    if self.shared is None:
      return jax.jit(init, out_shardings=self._member_sharding, compiler_options=options)(rngs)
    # The members' leaves from their own RNGs, the shared ones once (from member 0's; the
    # caller loads their values): two programs, each computing only its own leaves.
    abstract = jax.eval_shape(init_fn, rngs[0])
    mask, shardings = self.member_mask(abstract), self._shardings(abstract)

    def pick(tree, own):
      return [x for m, x in zip(jax.tree.leaves(mask), jax.tree.leaves(tree), strict=True)
              if m == own]

    members = jax.jit(lambda r: pick(init(r), True), out_shardings=pick(shardings, True),
                      compiler_options=options)(rngs)
    shared = jax.jit(lambda r: pick(init_fn(r), False), out_shardings=pick(shardings, False),
                     compiler_options=options)(rngs[0])
    members, shared = iter(members), iter(shared)
    return jax.tree.map(lambda m: next(members) if m else next(shared), mask)

  def _compile(self, fn: StepFn, loop: str, out_specs, state: PyTree,
               returns_state: bool = False, **jit_kwargs) -> StepFn:
    mask, specs = self.member_mask(state), self._specs(state)
    if returns_state:  # The new state placed as the old (a 1-device axis stays named).
      out_specs = (specs, out_specs)
      jit_kwargs["out_shardings"] = (self._shardings(state), self._member_sharding)
    per_device = jax.shard_map(
        self._over_local_members(fn, loop, mask, returns_state), mesh=self.mesh,
        in_specs=(specs, self._batch_spec()), out_specs=out_specs, check_vma=False)
    return jax.jit(per_device, in_shardings=(
        self._shardings(state), NamedSharding(self.mesh, self._batch_spec())), **jit_kwargs)

  def compile_train_step(self, step_fn: StepFn, state: PyTree) -> StepFn:
    return self._compile(step_fn, self.loop, PartitionSpec(ENSEMBLE), state,
                         returns_state=True, donate_argnums=0)

  def compile_train_chunk(self, chunk_fn: StepFn, state: PyTree) -> StepFn:
    mask, specs = self.member_mask(state), self._specs(state)
    per_device = jax.shard_map(
        self._over_local_members(chunk_fn, self.loop, mask, returns_state=True,
                                 batch_axis=1),
        mesh=self.mesh,
        in_specs=(specs, self._batch_spec(steps=True), PartitionSpec()),
        out_specs=(specs, PartitionSpec(ENSEMBLE)), check_vma=False)
    return jax.jit(per_device, in_shardings=(self._shardings(state),
                                             NamedSharding(self.mesh,
                                                           self._batch_spec(steps=True)),
                                             self._replicated_sharding),
                   out_shardings=(self._shardings(state), self._member_sharding),
                   donate_argnums=0)

  def compile_eval_step(self, eval_fn: StepFn, state: PyTree) -> StepFn:
    # Vectorised, so that `mean_over_members` has an axis to average over.
    return self._compile(eval_fn, "vmap", PartitionSpec(ENSEMBLE), state)

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
    """One model's abstract state with the member axis on every leaf but the shared ones."""
    return jax.tree.map(
        lambda m, x: jax.ShapeDtypeStruct(
            ((self.num_members,) if m else ()) + tuple(x.shape), x.dtype,
            sharding=self._member_sharding if m else self._shared_sharding),
        self.member_mask(abstract_state), abstract_state)

  def checkpoint_layout(self) -> dict:
    layout = super().checkpoint_layout()
    return {**layout, "shared": True} if self.shared is not None else layout

  def to_canonical(self, tree: PyTree) -> PyTree:
    """Host arrays with a member axis on every leaf: a shared leaf is seen by every member
    (a read-only view of its one copy, `np.broadcast_to`)."""
    host = super().to_canonical(tree)
    if self.shared is None:
      return host
    return jax.tree.map(
        lambda x, h: np.broadcast_to(h, (self.num_members,) + np.shape(h)) if held_once(x)
        else h, tree, host)

  def describe(self) -> str:
    return (f"{self.name}: {self.num_members} members, mesh (ensemble="
            f"{self.mesh.shape[ENSEMBLE]}, data={self.mesh.shape[DATA]}), "
            f"{self.members_per_device} member(s) per device run with {self.loop}"
            + (f", held once: {', '.join(getattr(self.shared, 'parts', ('frozen parts',)))}"
               if self.shared is not None else ""))
