"""Sweeps as ensembles: each member of an ensemble strategy trains with its own optimizer
hyperparameters and seed, in one compiled program (`config.sweep`).

A sweep is a list of members, each a point of hyperparameters and a seed:
`sweep.grid` (name -> values: their product) or `sweep.points` (one dict per
point), times `sweep.seeds`. The optimizer is built once with
`optax.inject_hyperparams`, so its hyperparameters are arrays in the
optimizer state; each member's state holds its own values, and one step
serves every member. The learning-rate schedule (warmup, then constant,
cosine or linear decay) is computed from the member's peak rate and warmup
in the step. Member i starts from `PRNGKey(seed_i)`, so it is the
single-model run with its hyperparameters and that seed.

Swept names: `learning_rate`, `weight_decay`, `momentum` (sgd), `b1` (adam,
adamw), `grad_clip_norm`, `warmup_steps` (`schedule.warmup_steps`), and
`ema_decay` (then kept in the state, `EmaTrainState.ema_decay`; every swept
value must be > 0, so that each member's single-model run has an EMA too).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from trainer.step.optim import (
  OPTIMIZERS,
  SCHEDULES,
  by_labels,
  default_decay_mask,
  param_groups,
)

PyTree = Any

#: Swept name -> the config field it replaces per member.
SWEPT = {"learning_rate": "learning_rate", "weight_decay": "weight_decay",
         "momentum": "momentum", "b1": "b1", "grad_clip_norm": "grad_clip_norm",
         "warmup_steps": "schedule.warmup_steps", "ema_decay": "ema_decay"}


def _config_value(config: ml_collections.ConfigDict, field: str) -> Any:
  node = config
  for part in field.split("."):
    node = node[part]
  return node


@dataclasses.dataclass(frozen=True)
class Sweep:
  """The members of a sweep: each one's hyperparameters (every swept name) and seed.

  Attributes:
    members: per member, `{name: value}` for every name in `SWEPT` plus `seed`.
    varied: the names whose values differ between members, in config order
      (`seed` last when there are several seeds): what labels a member.
  """

  members: tuple[Mapping[str, float], ...]
  varied: tuple[str, ...]

  def __len__(self) -> int:
    return len(self.members)

  def label(self, i: int) -> str:
    """`learning_rate=0.1,seed=1`: member i by the values that vary."""
    return ",".join(f"{name}={_fmt(self.members[i][name])}" for name in self.varied)

  def column(self, name: str) -> np.ndarray:
    """Every member's value of `name`."""
    return np.asarray([m[name] for m in self.members])

  def member_config(self, config: ml_collections.ConfigDict, i: int
                    ) -> ml_collections.ConfigDict:
    """The single-model config of member i: its values in place of the config's, no sweep."""
    out = ml_collections.ConfigDict(config.to_dict())
    for name, field in SWEPT.items():
      *parents, last = field.split(".")
      node = out
      for part in parents:
        node = node[part]
      node[last] = type(node[last])(self.members[i][name])
    out.seed = int(self.members[i]["seed"])
    out.sweep = ml_collections.ConfigDict(config.sweep.to_dict())
    for name in SWEPT:
      out.sweep.grid[name] = ()
    out.sweep.points, out.sweep.seeds = (), ()
    return out

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> Sweep | None:
    """The sweep `config.sweep` describes, or None when it sweeps nothing.

    Raises:
      ValueError: a point names something that cannot be swept, both `grid`
        and `points` are given, or a value is out of range.
    """
    s = config.sweep
    grid = {name: tuple(s.grid[name]) for name in SWEPT if len(s.grid[name])}
    points = [dict(p) for p in s.points]
    seeds = tuple(int(x) for x in s.seeds) or (config.seed,)
    if grid and points:
      raise ValueError(f"config.sweep.grid sweeps {sorted(grid)} and config.sweep.points has "
                       f"{len(points)} points; give one of them.")
    for p in points:
      unknown = set(p) - set(SWEPT)
      if unknown:
        raise ValueError(f"config.sweep.points has {sorted(unknown)}, which cannot be swept; "
                         f"the sweepable names are {sorted(SWEPT)}.")
    if not grid and not points and len(seeds) == 1 and not len(s.seeds):
      return None
    base = {name: _config_value(config, field) for name, field in SWEPT.items()}
    if grid:
      points = [dict(zip(grid, values, strict=True))
                for values in itertools.product(*grid.values())]
    points = points or [{}]
    members = tuple({**base, **p, "seed": seed} for p in points for seed in seeds)
    for m in members:
      _check_member(m)
    if (grid.get("ema_decay") or any("ema_decay" in p for p in points)) and min(
        m["ema_decay"] for m in members) <= 0:
      raise ValueError("config.sweep sweeps ema_decay with a value of 0; every swept decay "
                       "must be in (0, 1), so that each member's single-model run keeps an "
                       "EMA too.")
    varied = tuple(n for n in SWEPT if len({m[n] for m in members}) > 1)
    if len(seeds) > 1:
      varied += ("seed",)
    return cls(members, varied)


def check_sweep_fits(sweep: Sweep, strategy: Any) -> None:
  """Raises unless `strategy` is an ensemble of exactly the sweep's members.

  Raises:
    ValueError: naming the member count, the strategy and what would fit.
  """
  from strategies import Ensemble
  if not isinstance(strategy, Ensemble):
    raise ValueError(
        f"config.sweep describes {len(sweep)} members, but strategy {strategy.name!r} trains "
        f"one model; sweeps train as ensembles: set config.strategy.name to "
        f"'sharded_ensemble' (any member count that divides over its 'ensemble' mesh axis) "
        f"or 'pmap_ensemble' (one member per local device).")
  if strategy.num_members != len(sweep):
    raise ValueError(
        f"config.sweep describes {len(sweep)} members but the strategy {strategy.name!r} "
        f"holds {strategy.num_members} (config.ensemble_size={strategy.num_members}); set "
        f"config.ensemble_size=0 to take the sweep's count, or change the sweep.")


def _fmt(value: float) -> str:
  return f"{value:g}" if isinstance(value, float) else str(value)


def _check_member(m: Mapping[str, float]) -> None:
  checks = {"learning_rate": lambda v: v > 0, "weight_decay": lambda v: v >= 0,
            "momentum": lambda v: 0 <= v < 1, "b1": lambda v: 0 <= v < 1,
            "grad_clip_norm": lambda v: v >= 0,
            "warmup_steps": lambda v: float(v).is_integer() and v >= 0,
            "ema_decay": lambda v: 0 <= v < 1}
  for name, ok in checks.items():
    if not ok(m[name]):
      raise ValueError(f"config.sweep value {name}={m[name]!r} is out of range (learning_rate "
                       f"> 0; weight_decay, grad_clip_norm >= 0; momentum, b1, ema_decay in "
                       f"[0, 1); warmup_steps an integer >= 0).")


def schedule_value(count: jax.Array, *, peak: jax.Array, warmup: jax.Array, name: str,
                   num_train_steps: int | None, end_factor: float) -> jax.Array:
  """The learning rate at `count` for array-valued `peak` and `warmup` (per member).

  Linear warmup from 0, then `name` (constant, cosine or linear decay to
  `peak * end_factor` at `num_train_steps`): `create_schedule`'s shape.
  """
  count = jnp.asarray(count, jnp.float32)
  warmup = jnp.asarray(warmup, jnp.float32)
  warm = peak * count / jnp.maximum(warmup, 1.0)
  if name == "constant":
    after = peak
  else:
    frac = jnp.clip((count - warmup) / jnp.maximum(num_train_steps - warmup, 1.0), 0.0, 1.0)
    end = peak * end_factor
    after = (end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac)) if name == "cosine"
             else peak + (end - peak) * frac)
  return jnp.where(count < warmup, warm, after)


def swept_optimizer(config: ml_collections.ConfigDict, sweep: Sweep,
                    num_train_steps: int | None, *,
                    decay_mask: Callable[[PyTree], PyTree] = default_decay_mask,
                    labels: Callable[[PyTree], PyTree] | None = None,
                    ) -> optax.GradientTransformation:
  """The config's optimizer chain with every swept hyperparameter injected (arrays in the
  optimizer state, one value per member once `place_hyperparameters` has run).

  The chain has the parts of `create_optimizer`'s for the largest member values
  (clipping if any member clips, weight decay if any member decays); a member
  with 0 there gets the identity, exactly. With `labels` (`params -> label`,
  `trainer.step.optim.parameter_labels`) the parameters are grouped as
  `grouped_optimizer` groups them: frozen ones get no update and no state, a
  `config.param_groups` group scales the member's rate by its `lr_scale` and
  may fix its own `weight_decay`, and clipping sees the trainable gradients.
  """
  name, schedule = config.optimizer, config.schedule.name
  if name not in OPTIMIZERS:
    raise ValueError(f"config.optimizer={name!r} is not supported; choose one of: "
                     f"{', '.join(OPTIMIZERS)}.")
  if schedule not in SCHEDULES:
    raise ValueError(f"config.schedule.name={schedule!r} is not one of {SCHEDULES}.")
  clips = bool(sweep.column("grad_clip_norm").max() > 0)
  decays = bool(sweep.column("weight_decay").max() > 0)
  momentum = bool(sweep.column("momentum").max() > 0)
  end_factor = config.schedule.end_factor
  groups = param_groups(config) if labels is not None else []

  def chain(learning_rate, warmup_steps, weight_decay, momentum_value, b1, grad_clip_norm):
    def rate(count, scale=1.0):
      return scale * schedule_value(count, peak=learning_rate, warmup=warmup_steps,
                                    name=schedule, num_train_steps=num_train_steps,
                                    end_factor=end_factor)

    def optimizer(rate, weight_decay, decays):
      if name == "adamw":
        return [optax.adamw(rate, b1=b1, weight_decay=weight_decay, mask=decay_mask)]
      parts = [optax.add_decayed_weights(weight_decay, mask=decay_mask)] if decays else []
      return parts + [optax.sgd(rate, momentum=momentum_value if momentum else None)
                      if name == "sgd" else optax.adam(rate, b1=b1)]

    def chained(parts):
      return parts[0] if len(parts) == 1 else optax.chain(*parts)

    # 0: never clip (an infinite norm).
    clip = optax.clip_by_global_norm(jnp.where(grad_clip_norm > 0, grad_clip_norm, jnp.inf))
    if labels is None:
      return chained(([clip] if clips else []) + optimizer(rate, weight_decay, decays))

    def make(scale, decay):
      if scale is None:
        return chained(optimizer(rate, weight_decay, decays))
      return chained(optimizer(lambda count: rate(count, scale),
                               weight_decay if decay is None else decay,
                               decays or bool(decay)))

    return by_labels(make, groups, labels, clip=clip if clips else None)

  base = sweep.members[0]
  return optax.inject_hyperparams(chain)(
      learning_rate=base["learning_rate"], warmup_steps=base["warmup_steps"],
      weight_decay=base["weight_decay"], momentum_value=base["momentum"], b1=base["b1"],
      grad_clip_norm=base["grad_clip_norm"])


#: `swept_optimizer`'s injected argument -> the swept name it holds.
INJECTED = {"learning_rate": "learning_rate", "warmup_steps": "warmup_steps",
            "weight_decay": "weight_decay", "momentum_value": "momentum", "b1": "b1",
            "grad_clip_norm": "grad_clip_norm"}


def place_hyperparameters(state: PyTree, sweep: Sweep) -> PyTree:
  """A stacked ensemble state whose optimizer holds each member's own values.

  Each injected hyperparameter (an array with a leading member axis) is
  replaced by the members' values, placed as the array it replaces.
  """
  hyper = dict(state.opt_state.hyperparams)
  for arg, name in INJECTED.items():
    old = hyper[arg]
    values = np.asarray(sweep.column(name), dtype=old.dtype).reshape(old.shape)
    hyper[arg] = jax.device_put(values, old.sharding)
  state = state.replace(opt_state=state.opt_state._replace(hyperparams=hyper))
  if getattr(state, "ema_decay", None) is not None:
    old = state.ema_decay
    values = np.asarray(sweep.column("ema_decay"), dtype=old.dtype).reshape(old.shape)
    state = state.replace(ema_decay=jax.device_put(values, old.sharding))
  return state


def single_model_opt_state(opt_state: PyTree, target: PyTree) -> PyTree:
  """A member's injected optimizer state in the layout of a plain single-model optimizer
  (`target`: `create_optimizer(member config).init(params)`), for export.

  Raises:
    ValueError: the two hold different arrays (another optimizer).
  """
  leaves = jax.tree.leaves(opt_state.inner_state)
  want = jax.tree.leaves(target)
  if [np.shape(x) for x in leaves] != [np.shape(x) for x in want]:
    raise ValueError(f"the member's optimizer state holds arrays of shapes "
                     f"{[np.shape(x) for x in leaves]}, the single-model optimizer's "
                     f"{[np.shape(x) for x in want]}: not the same optimizer.")
  return jax.tree.unflatten(jax.tree.structure(target), leaves)


def summary_rows(sweep: Sweep, results: Sequence[Mapping[str, float]]) -> list[dict[str, Any]]:
  """One row per member: its label, swept values and results."""
  return [{"member": i, "label": sweep.label(i),
           **{n: sweep.members[i][n] for n in sweep.varied}, **dict(r)}
          for i, r in enumerate(results)]


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
  """A plain-text table of `rows` (one line each) under `columns`."""
  cells = [[str(c) for c in columns]] + [
      [f"{r[c]:.4f}" if isinstance(r[c], float) else str(r[c]) for c in columns] for r in rows]
  widths = [max(len(row[j]) for row in cells) for j in range(len(columns))]
  return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                   for row in cells)


def plot(rows: Sequence[Mapping[str, Any]], varied: Sequence[str], metric: str, best: int,
         path: str) -> None:
  """Saves a PNG of `metric` against each swept hyperparameter (one panel each; one colour
  per seed; the best member ringed)."""
  import matplotlib
  matplotlib.use("Agg")  # Files only: no display.
  from matplotlib import pyplot as plt

  names = [n for n in varied if n != "seed"] or ["seed"]
  fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
  seeds = sorted({r.get("seed", 0) for r in rows})
  for ax, name in zip(axes[0], names, strict=True):
    for seed in seeds:
      mine = [r for r in rows if r.get("seed", 0) == seed]
      ax.scatter([r[name] for r in mine], [r[metric] for r in mine], label=f"seed {seed}")
    ax.scatter([rows[best][name]], [rows[best][metric]], s=160, facecolors="none",
               edgecolors="black", label="best")
    values = [r[name] for r in rows]
    if min(values) > 0 and max(values) >= 10 * min(values):
      ax.set_xscale("log")
    ax.set_xlabel(name)
    ax.set_ylabel(metric)
  axes[0][0].legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)

