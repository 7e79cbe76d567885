"""Host device setup that must happen before jax initialises its backends."""

from __future__ import annotations

import jax
from absl import logging


def set_num_cpu_devices(n: int) -> None:
  """Makes a CPU-only host expose `n` devices (0 or None: jax's default).

  Call it before any jax computation. On hosts with an accelerator it changes
  nothing that runs there: only the CPU platform's device count is set.

  Raises:
    RuntimeError: jax's backends were already initialised with another count.
  """
  if not n:
    return
  try:
    jax.config.update("jax_num_cpu_devices", int(n))
  except RuntimeError as e:
    if len(jax.devices("cpu")) != n:
      raise RuntimeError(
          f"config.num_cpu_devices={n} must be set before jax starts, but jax already "
          f"runs with {len(jax.devices('cpu'))} CPU devices.") from e
  logging.info("CPU devices: %d; default backend: %s with %d device(s).",
               len(jax.devices("cpu")), jax.default_backend(), jax.device_count())
