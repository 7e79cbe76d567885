"""The optimizer recipe from config: learning-rate schedule, clipping, weight decay with a mask.

Fields read (all in `configs/base.py`): `optimizer`, `learning_rate` (the
peak), `momentum`, `b1`, `weight_decay`, `grad_clip_norm`, and `schedule.{name,
warmup_steps, end_factor}`. Each is read here and nowhere else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import optax

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "linear")

#: Parameter names that are never decayed: biases and normalisation scales.
NO_DECAY_NAMES = ("bias", "scale")

PyTree = Any


def default_decay_mask(params: PyTree) -> PyTree:
  """True for the weights weight decay applies to: kernels and embeddings.

  Biases and norm scales (named `bias` / `scale`, as Flax Linen and NNX name
  them, and any array of fewer than 2 dimensions) are left out, as in the
  BERT/ViT recipes.
  """

  def decays(path, x) -> bool:
    last = getattr(path[-1], "key", getattr(path[-1], "name", None)) if path else None
    if last == "value" and len(path) > 1:  # A Flax logical box's field.
      last = getattr(path[-2], "key", getattr(path[-2], "name", None))
    return jax.numpy.ndim(x) >= 2 and last not in NO_DECAY_NAMES

  return jax.tree_util.tree_map_with_path(decays, params)


def create_schedule(config: ml_collections.ConfigDict, num_train_steps: int) -> optax.Schedule:
  """`step -> learning rate`: linear warmup from 0, then constant, cosine or linear decay.

  Decay runs from the end of warmup to `num_train_steps`, down to
  `learning_rate * schedule.end_factor`.

  Raises:
    ValueError: an unknown schedule, a non-positive learning rate, or a
      warmup that does not fit in the run.
  """
  lr = config.learning_rate
  if not isinstance(lr, (int, float)) or lr <= 0:
    raise ValueError(f"config.learning_rate={lr!r} must be a positive number.")
  name = config.schedule.name
  warmup = config.schedule.warmup_steps
  end = lr * config.schedule.end_factor
  if name not in SCHEDULES:
    raise ValueError(f"config.schedule.name={name!r} is not one of {SCHEDULES}.")
  if not isinstance(warmup, int) or warmup < 0:
    raise ValueError(f"config.schedule.warmup_steps={warmup!r} must be an integer >= 0.")
  if name != "constant" and (num_train_steps is None or num_train_steps <= warmup):
    raise ValueError(
        f"config.schedule.name={name!r} decays over the run, so it needs the run's length: "
        f"num_train_steps={num_train_steps} must exceed config.schedule.warmup_steps={warmup}.")
  after = {"constant": lambda: optax.constant_schedule(lr),
           "cosine": lambda: optax.cosine_decay_schedule(lr, num_train_steps - warmup,
                                                         alpha=end / lr),
           "linear": lambda: optax.linear_schedule(lr, end, num_train_steps - warmup)}[name]()
  if not warmup:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])


def check_run_length(config: ml_collections.ConfigDict, schedule_steps: int | None,
                     num_steps: int) -> None:
  """Compares a run of `num_steps` with the `schedule_steps` its decaying schedule spans.

  Longer raises (the rate would sit at its floor for the extra steps); shorter
  warns, since stopping part-way and resuming later is a normal use.

  Raises:
    ValueError: the run goes past the end of a decaying schedule.
  """
  name = config.schedule.name
  if name == "constant" or num_steps == schedule_steps:
    return
  fix = (f"build the Trainer with num_train_steps={num_steps} (or set "
         f"config.num_train_steps={num_steps})")
  if num_steps > schedule_steps:
    raise ValueError(
        f"fit(num_steps={num_steps}) runs past the end of config.schedule.name={name!r}, "
        f"which decays over num_train_steps={schedule_steps} steps: the last "
        f"{num_steps - schedule_steps} steps would train at the final rate; {fix}.")
  logging.warning("fit(num_steps=%d) stops before config.schedule.name=%r has decayed: it is "
                  "built for num_train_steps=%d steps, so the run ends at a rate above its "
                  "end. If the run is not meant to resume later, %s.",
                  num_steps, name, schedule_steps, fix)


def create_optimizer(config: ml_collections.ConfigDict, schedule: optax.Schedule, *,
                     decay_mask: Callable[[PyTree], PyTree] = default_decay_mask,
                     ) -> optax.GradientTransformation:
  """An optax chain: clip by global norm, weight decay on `decay_mask`, the optimizer.

  `weight_decay` is decoupled for adamw (optax's `adamw(mask=)`); for sgd and
  adam it is added to the gradient (L2, as `torch.optim.SGD` does).

  Raises:
    ValueError: an unknown optimizer name, or a negative clip norm or decay.
  """
  name = config.optimizer
  clip = config.grad_clip_norm or 0.0
  decay = config.weight_decay or 0.0
  if name not in OPTIMIZERS:
    raise ValueError(f"config.optimizer={name!r} is not supported; choose one of: "
                     f"{', '.join(OPTIMIZERS)}.")
  if clip < 0:
    raise ValueError(f"config.grad_clip_norm={clip!r} must be >= 0 (0: no clipping).")
  if decay < 0:
    raise ValueError(f"config.weight_decay={decay!r} must be >= 0 (0: no weight decay).")
  parts = [optax.clip_by_global_norm(clip)] if clip else []
  if name == "adamw":
    parts.append(optax.adamw(schedule, b1=config.b1, weight_decay=decay, mask=decay_mask))
  else:
    if decay:
      parts.append(optax.add_decayed_weights(decay, mask=decay_mask))
    parts.append(optax.sgd(schedule, momentum=config.momentum or None) if name == "sgd"
                 else optax.adam(schedule, b1=config.b1))
  # One part stays unchained, so a plain optimizer's state has the plain layout.
  return parts[0] if len(parts) == 1 else optax.chain(*parts)
