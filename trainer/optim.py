"""Optimizers built from config fields (`optimizer`, `learning_rate`, `momentum`, ...)."""

from __future__ import annotations

import ml_collections
import optax

OPTIMIZERS = ("sgd", "adam", "adamw")


def create_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """An optax optimizer from `config.optimizer` and its hyperparameters.

  Fields: `optimizer` (one of OPTIMIZERS, default 'sgd'), `learning_rate`,
  `momentum` (sgd; 0 or None for plain SGD), `weight_decay` (adamw).

  Raises:
    ValueError: an unknown optimizer name or a non-positive learning rate.
  """
  name = config.get("optimizer", "sgd")
  lr = config.learning_rate
  if not lr or lr <= 0:
    raise ValueError(f"config.learning_rate={lr!r} must be a positive number.")
  if name == "sgd":
    return optax.sgd(lr, momentum=config.get("momentum") or None)
  if name == "adam":
    return optax.adam(lr)
  if name == "adamw":
    return optax.adamw(lr, weight_decay=config.get("weight_decay", 1e-4))
  raise ValueError(f"config.optimizer={name!r} is not supported; choose one of: "
                   f"{', '.join(OPTIMIZERS)}.")
