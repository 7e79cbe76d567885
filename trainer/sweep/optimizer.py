"""A sweep's optimizer: the config's chain with each member's hyperparameters in its state.

The chain is built once with `optax.inject_hyperparams`, so its
hyperparameters are arrays in the optimizer state; each member's state holds
its own values (`place_hyperparameters`), and one compiled step serves every
member. The learning-rate schedule (warmup, then constant, cosine or linear
decay) is computed from the member's peak rate and warmup in the step.
"""

from __future__ import annotations

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
from trainer.sweep.members import REFILLING, Sweep

PyTree = Any


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

  def chain(learning_rate, warmup_steps, weight_decay, momentum_value, b1, grad_clip_norm,
            active=None):
    del active  # Read by the recipe's `HoldInactive`, which keeps a frozen slot's state.

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
  # A scheduler that freezes slots (halving) keeps a per-slot `active` flag beside them.
  frozen = {"active": 1.0} if sweep.scheduler in REFILLING else {}
  # float32 hyperparameters, as the parameters are kept (`trainer.step.precision`): left to
  # optax, the dtype is the parameters' highest, which a QLoRA base's 4-bit codes refuse.
  return optax.inject_hyperparams(chain, hyperparam_dtype=jnp.float32)(
      learning_rate=base["learning_rate"], warmup_steps=base["warmup_steps"],
      weight_decay=base["weight_decay"], momentum_value=base["momentum"], b1=base["b1"],
      grad_clip_norm=base["grad_clip_norm"], **frozen)


#: `swept_optimizer`'s injected argument -> the swept name it holds.
INJECTED = {"learning_rate": "learning_rate", "warmup_steps": "warmup_steps",
            "weight_decay": "weight_decay", "momentum_value": "momentum", "b1": "b1",
            "grad_clip_norm": "grad_clip_norm"}


def place_hyperparameters(state: PyTree, sweep: Sweep) -> PyTree:
  """A stacked ensemble state whose optimizer holds each member's own values: the
  sweep's first configurations, one per member (every one of them, for a grid)."""
  num_slots = int(np.shape(state.step)[0])
  return place_rows(state, sweep.members[:num_slots])


def place_rows(state: PyTree, rows: Sequence[Mapping[str, float]],
               active: Sequence[bool] | None = None) -> PyTree:
  """A stacked ensemble state whose member i trains with `rows[i]`'s hyperparameters
  (and, where the optimizer keeps one, `active[i]`: False freezes it).

  Each injected hyperparameter (an array with a leading member axis) is
  replaced by the rows' values, placed as the array it replaces.
  """
  hyper = dict(state.opt_state.hyperparams)
  for arg, name in INJECTED.items():
    hyper[arg] = _placed([row[name] for row in rows], hyper[arg])
  if "active" in hyper:
    hyper["active"] = _placed([1.0 if a else 0.0 for a in (active or [True] * len(rows))],
                              hyper["active"])
  state = state.replace(opt_state=state.opt_state._replace(hyperparams=hyper))
  if getattr(state, "ema_decay", None) is not None:
    state = state.replace(ema_decay=_placed([row["ema_decay"] for row in rows],
                                            state.ema_decay))
  if getattr(state, "beta", None) is not None:  # A preference loss's (trainer.preference).
    state = state.replace(beta=_placed([row["beta"] for row in rows], state.beta))
  return state


def _placed(values: Sequence[float], like: jax.Array) -> jax.Array:
  return jax.device_put(np.asarray(values, dtype=like.dtype).reshape(like.shape), like.sharding)


def single_model_opt_state(opt_state: PyTree, target: PyTree) -> PyTree:
  """A member's injected optimizer state in the layout of a plain single-model optimizer
  (`target`: `create_optimizer(member config).init(params)`), for export and for restoring
  one member of a sweep's checkpoint. Both may be optax states or their state dicts.

  Raises:
    ValueError: the two hold different arrays (another optimizer).
  """
  inner = (opt_state["inner_state"] if isinstance(opt_state, Mapping)
           else opt_state.inner_state)
  leaves = jax.tree.leaves(inner)
  want = jax.tree.leaves(target)
  if [np.shape(x) for x in leaves] != [np.shape(x) for x in want]:
    raise ValueError(f"the member's optimizer state holds arrays of shapes "
                     f"{[np.shape(x) for x in leaves]}, the single-model optimizer's "
                     f"{[np.shape(x) for x in want]}: not the same optimizer.")
  return jax.tree.unflatten(jax.tree.structure(target), leaves)
