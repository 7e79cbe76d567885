"""Expert parallelism: a mixture of experts' experts split over an `expert` mesh axis.

A mesh axis named `expert`, the rule `("expert", "expert")` and the batch split over
it too (`("batch", ("data", "expert"))`, or `("batch", "expert")`) put `experts / size`
experts and `1 / size` of the tokens on each device. Every other layer works on its
rows as data parallelism does; the MoE feed-forward (`models.moe.expert_ffn`) runs on
each device's rows in a `shard_map` and sends each token's chosen experts' inputs to the
devices that hold them, and the results back, by all-to-all (`ExpertPlan.exchange`).

Two exchanges, picked by backend (`exchange_for`), with equal results:

- `all_to_all`: fixed-size buffers (`jax.lax.all_to_all`, which every backend compiles),
  sized for the worst case when dropless (all of a device's choices to one device) and
  for the capacity otherwise; on XLA:CPU, which does not compile the other ("HLO opcode
  `ragged-all-to-all` is not supported");
- `ragged_all_to_all` (GPU, TPU): the sizes are exchanged first, then each device sends
  each other exactly its choices for that device's experts.

Under `sharded_data_parallel` without an `expert` axis the plan still runs the MoE
feed-forward per device on its rows (no exchange), so the sort by expert never gathers
the batch. Expert weights may also be split within an expert: FSDP (`embed -> data`,
gathered when used) or tensor parallelism (`mlp -> model`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from strategies import layout
from strategies.tracing import Steering

PyTree = Any
#: The mesh axis experts are split over, and the logical name of the experts' axis.
EXPERT_AXIS = "expert"


class ExpertError(ValueError):
  """An expert-parallel layout or model that cannot work, found before compiling."""


@dataclasses.dataclass(frozen=True)
class ExpertPlan:
  """How the MoE feed-forward runs under a mesh (`models.moe.expert_ffn` reads it).

  Attributes:
    size: the `expert` axis's devices (1 without one).
    axis: the `expert` mesh axis, or None (each device computes every expert for its rows).
    batch_axes: the mesh axes the batch is split over.
    exchange: `all_to_all` (fixed-size buffers) or `ragged_all_to_all` (only the choices
      each device has for each other; not on XLA:CPU): `from_mesh` picks by backend.
  """

  size: int
  axis: str | None
  batch_axes: tuple[str, ...]
  exchange: str = "all_to_all"

  @property
  def manual_axes(self) -> tuple[str, ...]:
    """The mesh axes the feed-forward's `shard_map` takes by hand: the batch's (each device
    its own rows) and `expert`; the others (a tensor-parallel `model`) stay automatic."""
    return tuple(dict.fromkeys(self.batch_axes + ((self.axis,) if self.axis else ())))

  def all_to_all(self, x: jax.Array) -> jax.Array:
    """`x [size, ...]`, row `i` for device `i` -> row `j` from device `j`."""
    return jax.lax.all_to_all(x, self.axis, 0, 0)

  def check_experts(self, num_experts: int, where: str) -> None:
    """Raises `ExpertError` unless `num_experts` divide over the `expert` axis."""
    if self.axis and num_experts % self.size:
      raise ExpertError(
          f"config.model.num_experts={num_experts} does not divide over the "
          f"{EXPERT_AXIS!r} mesh axis ({EXPERT_AXIS}={self.size}; {where}): use a number of "
          f"experts that is a multiple of {self.size}, or an {EXPERT_AXIS!r} axis whose "
          f"size divides {num_experts}.")

  def describe(self) -> str:
    return (f"experts over {self.axis!r} ({self.axis}={self.size}), tokens by "
            f"{self.exchange}" if self.axis else "")


def from_mesh(mesh_shape: dict[str, int], rules, batch_axes: tuple[str, ...],
              axis_types: str, *, pipelined: bool, platform: str = "cpu") -> ExpertPlan | None:
  """The expert plan of a mesh (None where the feed-forward runs as the partitioner lays it
  out: under `explicit` axis types or in a pipeline without an `expert` axis), checked.

  Raises:
    ExpertError: an `expert` axis whose rules do not put `expert` (and the batch) on it,
      or with explicit axis types or a pipeline.
  """
  table = dict(rules)
  target = layout.axis_names(table.get(EXPERT_AXIS))
  if EXPERT_AXIS not in mesh_shape:
    if pipelined or axis_types != "auto" or not batch_axes:
      return None
    return ExpertPlan(size=1, axis=None, batch_axes=tuple(batch_axes))
  if target != (EXPERT_AXIS,):
    raise ExpertError(
        f"the mesh has an {EXPERT_AXIS!r} axis, but config.strategy.logical_axis_rules maps "
        f"{EXPERT_AXIS!r} to {table.get(EXPERT_AXIS)!r}: add the rule ({EXPERT_AXIS!r}, "
        f"{EXPERT_AXIS!r}) so each device holds its share of the experts.")
  if EXPERT_AXIS not in batch_axes:
    raise ExpertError(
        f"the mesh has an {EXPERT_AXIS!r} axis, but the batch is split over {batch_axes} "
        f"only (config.strategy.logical_axis_rules' 'batch' rule): split it over "
        f"{EXPERT_AXIS!r} too, e.g. ('batch', ('data', {EXPERT_AXIS!r})), so each expert "
        f"device routes its own tokens.")
  others = [name for name, t in rules
            if name not in (EXPERT_AXIS, "batch") and EXPERT_AXIS in layout.axis_names(t)]
  if others:
    raise ExpertError(
        f"config.strategy.logical_axis_rules maps {others} to the {EXPERT_AXIS!r} axis, "
        f"which only the experts ({EXPERT_AXIS!r}) and the batch may use.")
  if axis_types != "auto":
    raise ExpertError(f"config.strategy.axis_types={axis_types!r}: expert parallelism runs "
                      f"under 'auto' axis types only.")
  if pipelined:
    raise ExpertError(
        f"the mesh has both a 'stage' and an {EXPERT_AXIS!r} axis: a pipeline with expert "
        f"parallelism is not supported; use one of them (an MoE model runs under either).")
  return ExpertPlan(size=mesh_shape[EXPERT_AXIS], axis=EXPERT_AXIS,
                    batch_axes=tuple(batch_axes), exchange=exchange_for(platform))


def exchange_for(platform: str) -> str:
  """`ragged_all_to_all` where the backend compiles it (GPU, TPU), else `all_to_all`."""
  return "all_to_all" if platform == "cpu" else "ragged_all_to_all"


def check_state(plan: ExpertPlan | None, abstract_state: PyTree) -> None:
  """Raises unless a model under an `expert` axis has experts, as many as divide over it.

  Raises:
    ExpertError: no parameter names the `expert` axis, or their count does not divide.
  """
  if plan is None or plan.axis is None:
    return
  experts = {}
  for path, shape, _, names, _ in layout.annotations(abstract_state):
    if EXPERT_AXIS in names:
      experts[path] = shape[names.index(EXPERT_AXIS)]
  if not experts:
    raise ExpertError(
        f"the mesh has an {EXPERT_AXIS!r} axis ({EXPERT_AXIS}={plan.size}), but no parameter "
        f"of the model names an {EXPERT_AXIS!r} axis: it has no experts to split. Set "
        f"config.model.num_experts (a mixture of experts, models/moe.py), or train without "
        f"an {EXPERT_AXIS!r} axis.")
  for path, n in experts.items():
    plan.check_experts(n, f"parameter {path}")


#: The expert plan a strategy sets while tracing (the parameter check, not the trace,
#: refuses a model without experts).
STEERING = Steering("expert")  # Its plan: an `ExpertPlan`.
#: The expert plan a strategy set for the step being traced, or None.
current = STEERING.current
#: The MoE feed-forward traced inside runs by the given plan (None: on the whole batch).
active = STEERING.active
