"""Strategy names, in one place: `config.strategy.name` resolves here."""

from __future__ import annotations

from collections.abc import Callable

import jax
import ml_collections

from strategies import context, pipeline
from strategies.base import Strategy
from strategies.capabilities import Ensemble

_FACTORIES: dict[str, Callable[[ml_collections.ConfigDict], Strategy]] = {}
_CLASSES: dict[str, type[Strategy]] = {}


def register(name: str):
  """Class decorator that registers a strategy under `name`.

  The class must provide `from_config(config) -> Strategy`, which reads the
  fields it needs from the whole run config.
  """

  def decorator(cls):
    if name in _FACTORIES:
      raise ValueError(f"strategy name {name!r} is registered twice")
    cls.name = name
    _FACTORIES[name] = cls.from_config
    _CLASSES[name] = cls
    return cls

  return decorator


def available() -> list[str]:
  """The registered strategy names, sorted."""
  return sorted(_FACTORIES)


def multi_process_strategies() -> list[str]:
  """The registered strategies whose mesh can span several processes."""
  return [name for name in available() if getattr(_CLASSES[name], "spans_processes", False)]


def check_processes(cls: type[Strategy]) -> None:
  """Raises ValueError on a multi-process run if strategy `cls` sees one process's devices."""
  if jax.process_count() > 1 and not getattr(cls, "spans_processes", False):
    raise ValueError(
        f"config.strategy.name={cls.name!r} places everything on the devices of one "
        f"process, but this run has {jax.process_count()} processes (jax.distributed); "
        f"use one of {multi_process_strategies()}, whose mesh spans all processes.")


def create_strategy(config: ml_collections.ConfigDict) -> Strategy:
  """Builds the strategy named by `config.strategy.name`, validating its fields.

  Raises:
    ValueError: the name is not registered, or the strategy's fields are invalid.
  """
  name = config.strategy.name
  if name not in _FACTORIES:
    raise ValueError(
        f"config.strategy.name={name!r} is not a registered strategy; "
        f"choose one of: {', '.join(available())}.")
  check_processes(_CLASSES[name])  # Before the strategy's own checks of device counts.
  if issubclass(_CLASSES[name], Ensemble):
    pipeline.check_unused(config)  # The one-model strategies run the stack as a scan.
    context.check_unused(config)  # An ensemble's members hold whole sequences.
  return _FACTORIES[name](config)
