"""The orbax handler of the `state` item: orbax's standard one, without replica slicing on CPU.

Orbax writes an array that several devices hold whole (a replicated parameter) in
"replica-parallel" slices: each replica writes 1/R of it, cut by its own jitted
`slice` program, one per array and replica. On accelerators that spreads the
device-to-host copies; orbax already turns it off for GPUs. On CPU every device is
the host's memory, so the slices are copies that each cost a program: a save of
the transformer LM under data parallelism on 8 CPU devices dispatched 364 of them,
4 of its 12 seconds (`tests/test_checkpoint.py` counts them). There each array is
written whole by its first replica instead, as a GPU's would be; the files hold the
same arrays either way and read back the same, whichever wrote them.
"""

from __future__ import annotations

import inspect
import logging

import jax
import numpy as np
import orbax.checkpoint as ocp


def _array_handler_without_replica_slices() -> ocp.type_handlers.TypeHandler | None:
  """Orbax's default `jax.Array` handler with `use_replica_parallel=False`, or None where this
  orbax no longer builds it the same way (its default is then kept: slower, not different)."""
  try:
    from orbax.checkpoint._src.metadata import array_metadata_store
    return ocp.type_handlers.ArrayHandler(
        use_replica_parallel=False, array_metadata_store=array_metadata_store.Store())
  except (ImportError, AttributeError, TypeError) as e:  # A later orbax moved them.
    logging.debug("Keeping orbax's replica-parallel saving: %s", e)
    return None


def state_handler() -> ocp.StandardCheckpointHandler:
  """The `state` item's handler: `ocp.StandardCheckpointHandler` (same arguments, same files),
  whose `jax.Array` leaves are written without replica slicing when the devices are CPUs."""
  handler = ocp.StandardCheckpointHandler()
  arrays = _array_handler_without_replica_slices() if jax.default_backend() == "cpu" else None
  if arrays is None or not isinstance(getattr(handler, "_impl", None),
                                      ocp.PyTreeCheckpointHandler):
    return handler
  kinds = (int, float, bytes, np.number, np.ndarray, str, type(ocp.PLACEHOLDER))
  registry = ocp.type_handlers.create_type_handler_registry(
      *((kind, ocp.type_handlers.get_type_handler(kind)) for kind in kinds),
      (jax.Array, arrays))
  # The standard handler checks its arguments and hands them to a PyTree handler made with
  # its own defaults (concurrency limits, OCDBT); only the registry `jax.Array`'s writer is
  # looked up in differs from orbax's global one.
  defaults = {name: p.default for name, p in
              inspect.signature(ocp.StandardCheckpointHandler).parameters.items()
              if p.default is not inspect.Parameter.empty}
  try:
    handler._impl = ocp.PyTreeCheckpointHandler(**defaults, type_handler_registry=registry)
  except TypeError as e:  # A later orbax's standard handler takes what its PyTree one does not.
    logging.debug("Keeping orbax's replica-parallel saving: %s", e)
  return handler
