"""How a strategy steers a model while its step is traced: one helper for every plan.

A strategy that changes what a model's layers compute (the pipeline runs a layer stack
over stages, the context plan splits attention over a `context` axis, the expert plan
exchanges tokens over an `expert` axis) cannot pass its plan through the user's module:
the module is the user's, and its `__call__` takes only its inputs. Instead the strategy
sets the plan around the traced step (`Steering.active`), and the shared layers
(`models.layer_stack`, `models.attention`, `models.moe`) read it while they are traced
(`Steering.current`). A plan that only works if the model calls the shared layer wraps
the step in `Steering.requiring`: the layer says it ran (`Steering.record`), and a trace
that recorded nothing is refused, since the model's own layer would have run unsteered::

    PLAN = Steering("pipeline")
    with PLAN.active(pipeline):             # the strategy, around the traced step
      jax.jit(PLAN.requiring(step, refuse)).lower(...)
    plan = PLAN.current()                   # the shared layer, while traced
    PLAN.record(plan)                       # ... and that it ran

Context variables, so two steps traced in two threads each see their own plan.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any


class Steering:
  """One plan a strategy sets while tracing, and what the model did with it.

  Args:
    name: the plan's name (its context variables are named after it).
  """

  def __init__(self, name: str):
    self.name = name
    self._plan: contextvars.ContextVar[Any] = contextvars.ContextVar(
        f"{name}_plan", default=None)
    self._uses: contextvars.ContextVar[list | None] = contextvars.ContextVar(
        f"{name}_uses", default=None)

  def current(self) -> Any:
    """The plan a strategy set for the step being traced, or None."""
    return self._plan.get()

  @contextlib.contextmanager
  def active(self, plan: Any) -> Iterator[None]:
    """Shared layers traced inside read `plan` (None: they run unsteered); the previous
    plan is back on exit."""
    token = self._plan.set(plan)
    try:
      yield
    finally:
      self._plan.reset(token)

  def record(self, use: Any) -> None:
    """Called by a shared layer each time it is traced under `requiring`."""
    if (uses := self._uses.get()) is not None:
      uses.append(use)

  def requiring(self, fn: Callable, refusal: Callable[[], Exception]) -> Callable:
    """`fn` (a step), raising `refusal()` once it is traced if no shared layer recorded a
    use (`record`) while it was."""
    def traced(*args, **kwargs):
      token = self._uses.set([])
      try:
        out = fn(*args, **kwargs)
        uses = self._uses.get()
      finally:
        self._uses.reset(token)
      if not uses:
        raise refusal()
      return out

    return traced
