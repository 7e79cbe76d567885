"""The optimizer recipe from config: learning-rate schedule, clipping, weight decay with a mask.

Fields read (all in `configs/base.py`): `optimizer`, `learning_rate` (the
peak), `momentum`, `b1`, `weight_decay`, `grad_clip_norm`, and `schedule.{name,
warmup_steps, end_factor}`. Each is read here and nowhere else.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import ml_collections
import optax

from strategies.tree import keypath_str

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
  check_schedule(config)
  lr, name, warmup = config.learning_rate, config.schedule.name, config.schedule.warmup_steps
  end = lr * config.schedule.end_factor
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


def check_schedule(config: ml_collections.ConfigDict) -> None:
  """Raises unless `learning_rate` and `schedule.{name, warmup_steps}` are usable.

  Raises:
    ValueError: naming the field, its value and what is accepted.
  """
  lr = config.learning_rate
  if not isinstance(lr, (int, float)) or lr <= 0:
    raise ValueError(f"config.learning_rate={lr!r} must be a positive number.")
  if config.schedule.name not in SCHEDULES:
    raise ValueError(f"config.schedule.name={config.schedule.name!r} is not one of "
                     f"{SCHEDULES}.")
  warmup = config.schedule.warmup_steps
  if not isinstance(warmup, int) or warmup < 0:
    raise ValueError(f"config.schedule.warmup_steps={warmup!r} must be an integer >= 0.")


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
                     clip: bool = True) -> optax.GradientTransformation:
  """An optax chain: clip by global norm, weight decay on `decay_mask`, the optimizer.

  `weight_decay` is decoupled for adamw (optax's `adamw(mask=)`); for sgd and
  adam it is added to the gradient (L2, as `torch.optim.SGD` does).

  Raises:
    ValueError: an unknown optimizer name, or a negative clip norm or decay.
  """
  name = config.optimizer
  clip_norm = config.grad_clip_norm or 0.0
  decay = config.weight_decay or 0.0
  if name not in OPTIMIZERS:
    raise ValueError(f"config.optimizer={name!r} is not supported; choose one of: "
                     f"{', '.join(OPTIMIZERS)}.")
  if clip_norm < 0:
    raise ValueError(f"config.grad_clip_norm={clip_norm!r} must be >= 0 (0: no clipping).")
  if decay < 0:
    raise ValueError(f"config.weight_decay={decay!r} must be >= 0 (0: no weight decay).")
  parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm and clip else []
  if name == "adamw":
    parts.append(optax.adamw(schedule, b1=config.b1, weight_decay=decay, mask=decay_mask))
  else:
    if decay:
      parts.append(optax.add_decayed_weights(decay, mask=decay_mask))
    parts.append(optax.sgd(schedule, momentum=config.momentum or None) if name == "sgd"
                 else optax.adam(schedule, b1=config.b1))
  # One part stays unchained, so a plain optimizer's state has the plain layout.
  return parts[0] if len(parts) == 1 else optax.chain(*parts)


#: The label of frozen parameters in `parameter_labels`; the rest are `default` or a group's.
FROZEN, DEFAULT = "frozen", "default"


def frozen_patterns(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The path patterns of frozen parameters: `config.freeze`, or with `config.lora` every
  parameter that is not an adapter (`trainer.step.lora.BASE`)."""
  from trainer.step import lora
  return (lora.BASE,) if config.lora.rank else tuple(config.freeze)


def parameter_labels(params: PyTree, *, freeze: Sequence[str],
                     groups: Sequence[Mapping[str, Any]]) -> PyTree:
  """Each parameter's label: `frozen`, `group<i>` or `default`, by path patterns.

  A path is the parameter's `/`-joined names (`Conv_0/kernel`); a pattern is a
  regular expression that must match the whole path (`Conv_.*`).

  Raises:
    ValueError: a pattern that matches no parameter (naming it and the paths),
      or a parameter that two patterns claim (naming both).
  """
  paths = {keypath_str(p, drop_box=True): None
           for p, _ in jax.tree_util.tree_leaves_with_path(params)}
  patterns = ([("config.freeze", p, FROZEN) for p in freeze]
              + [(f"config.param_groups[{i}]", g["pattern"], f"group{i}")
                 for i, g in enumerate(groups)])
  for field, pattern, label in patterns:
    matched = [path for path in paths if re.fullmatch(pattern, path)]
    if not matched:
      raise ValueError(f"{field} pattern {pattern!r} matches no parameter; the parameters are "
                       f"{sorted(paths)}.")
    for path in matched:
      if paths[path] is not None:
        raise ValueError(f"parameter {path!r} is claimed by {paths[path][0]} pattern "
                         f"{paths[path][1]!r} and by {field} pattern {pattern!r}; give each "
                         f"parameter one group.")
      paths[path] = (field, pattern, label)
  return jax.tree_util.tree_map_with_path(
      lambda p, _: (paths[keypath_str(p, drop_box=True)] or (None, None, DEFAULT))[2], params)


def param_groups(config: ml_collections.ConfigDict) -> list[dict[str, Any]]:
  """`config.param_groups` as dicts, checked.

  Raises:
    ValueError: a group without a `pattern`, or with other keys than
      `pattern`, `lr_scale`, `weight_decay`.
  """
  groups = [dict(g) for g in config.param_groups]
  for i, g in enumerate(groups):
    unknown = set(g) - {"pattern", "lr_scale", "weight_decay"}
    if "pattern" not in g or unknown:
      raise ValueError(f"config.param_groups[{i}]={g!r} must have a 'pattern' and may have "
                       f"'lr_scale' and 'weight_decay' (got {sorted(unknown)} besides).")
  return groups


def by_labels(make: Callable[[float | None, float | None], optax.GradientTransformation],
              groups: Sequence[Mapping[str, Any]], labels: Callable[[PyTree], PyTree], *,
              clip: optax.GradientTransformation | None = None,
              ) -> optax.GradientTransformation:
  """One optimizer per label: zero updates and no state for `frozen` parameters,
  `make(None, None)` for the `default` ones, `make(lr_scale, weight_decay or None)` for
  group i; `clip` first, over the trainable parameters' gradients only."""
  transforms = {FROZEN: optax.set_to_zero(), DEFAULT: make(None, None)}
  for i, g in enumerate(groups):
    transforms[f"group{i}"] = make(g.get("lr_scale", 1.0), g.get("weight_decay"))
  grouped = optax.multi_transform(transforms, labels)
  if clip is None:
    return grouped
  trainable = lambda params: jax.tree.map(lambda label: label != FROZEN,  # noqa: E731
                                          labels(params))
  return optax.chain(optax.masked(clip, trainable), grouped)


def grouped_optimizer(config: ml_collections.ConfigDict, schedule: optax.Schedule, *,
                      decay_mask: Callable[[PyTree], PyTree] = default_decay_mask,
                      labels: Callable[[PyTree], PyTree] | None = None,
                      ) -> optax.GradientTransformation:
  """`create_optimizer` per parameter group (`config.freeze`, `config.param_groups`).

  Frozen parameters get zero updates and no optimizer state
  (`optax.set_to_zero` under `optax.multi_transform`); each group gets the
  config's optimizer with its learning rate scaled by `lr_scale` and its own
  `weight_decay`. Clipping by `grad_clip_norm` runs first, over the trainable
  parameters' gradients only. `labels` (`params -> label per parameter`)
  replaces the config's patterns (`parameter_labels`).

  Raises:
    ValueError: `param_groups` refuses a group.
  """
  groups = param_groups(config)
  freeze = tuple(config.freeze)
  if labels is None:
    def labels(params):
      return parameter_labels(params, freeze=freeze, groups=groups)

  def make(scale, decay):
    if scale is None:
      return create_optimizer(config, schedule, decay_mask=decay_mask, clip=False)
    group_config = ml_collections.ConfigDict(config.to_dict())
    group_config.weight_decay = config.weight_decay if decay is None else decay
    return create_optimizer(group_config, lambda step: scale * schedule(step),
                            decay_mask=decay_mask, clip=False)

  clip = optax.clip_by_global_norm(config.grad_clip_norm) if config.grad_clip_norm else None
  return by_labels(make, groups, labels, clip=clip)


def optimizer_for(config: ml_collections.ConfigDict, schedule: optax.Schedule, *,
                  labels: Callable[[PyTree], PyTree] | None = None,
                  ) -> optax.GradientTransformation:
  """The config's optimizer: per parameter group (`grouped_optimizer`) when `labels` is
  given (the Trainer's `parameter_labels`, when parameters are grouped), else
  `create_optimizer`."""
  if labels is not None:
    return grouped_optimizer(config, schedule, labels=labels)
  return create_optimizer(config, schedule)


def check_config(config: ml_collections.ConfigDict, *, swept: bool) -> None:
  """Raises unless the optimizer fields are usable: builds the chain, touching no array.

  A sweep's hyperparameters are checked per member (`trainer.sweep.Sweep`);
  here only what every member shares. Whether a decaying schedule knows the
  run's length is `create_schedule`'s to say, when the default schedule is built.

  Raises:
    ValueError: naming the field, its value and what is accepted.
  """
  param_groups(config)
  if swept:
    if config.optimizer not in OPTIMIZERS:
      raise ValueError(f"config.optimizer={config.optimizer!r} is not supported; choose one "
                       f"of: {', '.join(OPTIMIZERS)}.")
    if config.schedule.name not in SCHEDULES:
      raise ValueError(f"config.schedule.name={config.schedule.name!r} is not one of "
                       f"{SCHEDULES}.")
    return
  check_schedule(config)
  create_optimizer(config, optax.constant_schedule(config.learning_rate))
