"""Host functions called from inside a compiled step, whose errors end the run cleanly.

A step may call Python on the host (`jax.pure_callback`: RL's rewards read the decoded
completions). An exception raised there fails the device program that made the call,
while the other devices of a sharded step wait in their next collective for the
missing one (XLA:CPU gives up after about 40 s and aborts the process). So
`HostCalls.call` never lets a host function raise into XLA: it keeps the first error,
answers that call and every later one with NaN in place of the results and `False` in
place of `ok`, and the step completes on every device. The step makes its update
non-finite where `ok` is False, so no action that reads the state (a checkpoint) ever
sees it, and the loop raises the kept error (`raise_if_failed`) as soon as the call's
results are on the host: once, with its own message, nothing saved lost.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


class HostCalls:
  """The host functions a Trainer's steps call, and the first error they raised."""

  def __init__(self):
    self._lock = threading.Lock()
    self._error: BaseException | None = None

  @property
  def failed(self) -> bool:
    return self._error is not None

  def call(self, fn: Callable[..., PyTree], result_shapes: PyTree, *args,
           vmap_method: str = "sequential") -> tuple[PyTree, jax.Array]:
    """`jax.pure_callback(fn, result_shapes, *args)` and an `ok` flag (a bool scalar):
    False, and NaN (or 0 for integers) results, once `fn` or an earlier call has raised.
    """
    def guarded(*host_args):
      if self._error is None:
        try:
          return fn(*host_args), np.bool_(True)
        except Exception as e:  # Kept, and raised by `raise_if_failed`, outside XLA.
          with self._lock:
            if self._error is None:
              self._error = e
      return jax.tree.map(_filler, result_shapes), np.bool_(False)

    shapes = (result_shapes, jax.ShapeDtypeStruct((), jnp.bool_))
    return jax.pure_callback(guarded, shapes, *args, vmap_method=vmap_method)

  def raise_if_failed(self) -> None:
    """Raises the first error a host function raised (once: it is then cleared)."""
    with self._lock:
      error, self._error = self._error, None
    if error is not None:
      raise error


def _filler(shape: jax.ShapeDtypeStruct) -> np.ndarray:
  dtype = np.dtype(shape.dtype)
  fill = np.nan if np.issubdtype(dtype, np.inexact) else 0
  return np.full(shape.shape, fill, dtype)
