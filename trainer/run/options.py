"""The run's own config fields, read and checked in one place.

`steps_per_call`, `prefetch_to_device`, `watchdog_seconds` and
`watchdog_slow_seconds` say how `fit` drives the compiled steps; nothing else
reads them. (`steps_loop`, how a call's steps run, belongs to the compiled
steps: `trainer.step.functions.steps_loop_from_config`.)
"""

from __future__ import annotations

import dataclasses

import ml_collections


@dataclasses.dataclass(frozen=True)
class RunOptions:
  """How a run feeds and calls the compiled train step, and when it gives up on one.

  Attributes:
    steps_per_call: train steps one compiled call runs (`trainer.loop.chunks`).
    prefetch: calls' batches placed on the devices ahead of their call.
    watchdog_seconds: the process exits when no call or action finishes for this
      long (0: no watchdog; `trainer.loop.timing.Watchdog`).
    watchdog_slow_seconds: the limit for compilation, evaluation and checkpoints.
  """

  steps_per_call: int = 1
  prefetch: int = 1
  watchdog_seconds: float = 0.0
  watchdog_slow_seconds: float = 0.0

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict) -> RunOptions:
    """Reads `steps_per_call`, `prefetch_to_device` and the watchdog's limits.

    Raises:
      ValueError: naming the field, its value and what it accepts.
    """
    prefetch, steps = config.prefetch_to_device, config.steps_per_call
    if not isinstance(prefetch, int) or prefetch < 0:
      raise ValueError(f"config.prefetch_to_device={prefetch!r} must be an integer >= 0: "
                       f"how many train batches are put on the devices ahead of their step.")
    if not isinstance(steps, int) or steps < 1:
      raise ValueError(f"config.steps_per_call={steps!r} must be an integer >= 1: how many "
                       f"train steps one compiled call runs.")
    for field, zero in (("watchdog_seconds", "no watchdog"),
                        ("watchdog_slow_seconds", "10x watchdog_seconds")):
      value = config[field]
      if not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"config.{field}={value!r} must be a number of seconds >= 0 "
                         f"(0: {zero}).")
    seconds = float(config.watchdog_seconds)
    return cls(steps_per_call=steps, prefetch=prefetch, watchdog_seconds=seconds,
               watchdog_slow_seconds=float(config.watchdog_slow_seconds) or 10 * seconds)
