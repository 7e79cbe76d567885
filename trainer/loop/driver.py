"""The training loop: advance the state, run the actions, assemble the result.

`run` is the whole loop. `advance(state, step)` runs one compiled call (one
train step, or several: `trainer.loop.chunks` plans how many) and returns the
new state, the call's outputs, the new step and the data position. After each
call every action whose trigger holds runs, in order, on an immutable
`StepView`; what it returns is folded into the view the next action sees and
into the `FitResult`.

One rule belongs to the loop rather than to any action: no action that reads
the state (`Action.needs_checked_step`) ever sees a non-finite one. The
`finite` flag of a call is checked after the next call is queued, so the host
never waits for a step, except right before such an action and at the end.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from trainer.loop.actions import Action, FitResult, Produced, StepView
from trainer.loop.timing import LoopClock

PyTree = Any
#: `(state, step) -> (state, outputs, new step, data position)`: one compiled call.
Advance = Callable[[Any, int], tuple[Any, PyTree, int, Any]]


class NonFiniteError(FloatingPointError):
  """A train step produced a non-finite loss or gradient norm under `nonfinite='stop'`."""


class FiniteCheck:
  """Reads each call's `finite` flags, one call behind: raises, or counts skipped updates.

  A call of several steps has a flag per step (on the strategy's
  `steps_axis`); the first non-finite one is reported by its own step.

  Args:
    skip: the recipe leaves non-finite updates out (`nonfinite='skip'`): count
      them instead of raising.
    to_host: the strategy's host view of a flag (per replica or per member).
    which_models: names the members whose flags are False (ensembles).
    saved_note: says which checkpoint is the last finite state, for the error.
    steps_axis: where a call's flags hold its steps; None: a call runs one step.
    host_error: raises the first error of a host function the steps called
      (`trainer.step.host_calls`), which made that call's flags False: checked once a
      call's flags are on the host, before they are.
  """

  def __init__(self, *, skip: bool, to_host: Callable[[Any], Any],
               which_models: Callable[[np.ndarray], str], saved_note: Callable[[], str],
               steps_axis: int | None = None, host_error: Callable[[], None] | None = None):
    self.skip, self.to_host, self.which_models = skip, to_host, which_models
    self.saved_note, self.steps_axis = saved_note, steps_axis
    self.host_error = host_error or (lambda: None)
    self._unchecked: list[tuple[int, Any]] = []
    #: The steps whose updates were left out so far (`skip`).
    self.skipped_at: list[int] = []

  @property
  def skipped(self) -> int:
    """Updates left out so far (`skip`)."""
    return len(self.skipped_at)

  def push(self, step: int, flag: Any) -> None:
    """Checks the calls before this one and keeps this one's flags (`step`: after it)."""
    self.settle()
    self._unchecked.append((step, flag))

  def settle(self) -> None:
    """Checks every flag not yet checked (waiting for its call)."""
    while self._unchecked:
      last, flag = self._unchecked.pop(0)
      ok = np.asarray(self.to_host(flag))
      self.host_error()
      if ok.all():
        continue
      per_step = (ok.reshape(1, -1) if self.steps_axis is None
                  else np.moveaxis(ok, self.steps_axis, 0).reshape(ok.shape[self.steps_axis], -1))
      for step, flags in enumerate(per_step, start=last - len(per_step) + 1):
        if flags.all():
          continue
        if not self.skip:
          raise NonFiniteError(
              f"step {step}{self.which_models(flags)}: the loss or the gradient norm is not "
              f"finite, so training stopped (config.nonfinite='stop'; 'skip' would leave "
              f"such updates out); {self.saved_note()}.")
        self.skipped_at.append(step)
        logging.warning("Step %d%s: non-finite loss or gradient norm; update skipped "
                        "(%d so far)", step, self.which_models(flags), self.skipped)


def _fold(view: StepView, produced: Produced | None, result: FitResult) -> StepView:
  """The view the next action sees, and the result, with what an action produced."""
  if produced is None:
    return view
  changes: dict[str, Any] = {}
  if produced.eval_results is not None:
    result.eval_history.append((view.step, dict(produced.eval_results)))
    changes.update(eval_results=produced.eval_results,
                   eval_seconds=view.eval_seconds + produced.eval_seconds)
  if produced.best is not None:
    result.best = produced.best
  if produced.state is not None:
    changes.update(state=produced.state)
  if produced.stop is not None and view.stop_reason is None:
    logging.info("Stop requested at step %d: %s", view.step, produced.stop)
    changes.update(stop_reason=produced.stop, preempted=produced.preempted)
  return dataclasses.replace(view, **changes) if changes else view


def run(advance: Advance, *, state: Any, start: int, num_steps: int,
        actions: Sequence[Action], finite: FiniteCheck | None = None,
        canonical: Callable[[PyTree], PyTree] = lambda tree: tree,
        steps_axis: int | None = None, clock: LoopClock | None = None,
        flops: Any = None, tokens_per_step: int | None = None) -> FitResult:
  """Advances from `start` until `num_steps` (or a requested stop), running the actions:
  each one's `begin` before the first call, `run` after each call at which it triggers,
  `end` after the last call, and `close` always, last, also after an error.

  `clock` accounts each call as `train` (or `compile`: `advance.compiles_at(step)`; such a
  call is waited for, so its first run, with the collectives' set-up, counts as one-time
  work and gets the watchdog's slow limit), each
  action by its `time_category`, the rest as `other`. The other arguments go into views.
  """
  clock = clock or LoopClock()
  result = FitResult(state=state, step=start, step_flops=flops)
  view = StepView(step=start, previous_step=start, num_steps=num_steps, start_step=start,
                  state=state, canonical=canonical, action_states=_states_of(actions),
                  steps_axis=steps_axis, flops=flops, tokens_per_step=tokens_per_step)
  compiles_at = getattr(advance, "compiles_at", lambda step: False)
  begun: list[Action] = []
  try:
    with clock.measure("other"):  # What no inner measurement claims: the loop's own time.
      for action in actions:
        view = _act(action.begin, action, view, result, clock)
        begun.append(action)
      while view.step < num_steps and view.stop_reason is None:
        view = _call(advance, view, finite, clock, compiles=compiles_at(view.step))
        for action in actions:
          if action.triggers(view):
            if action.needs_checked_step(view):
              view = _checked(view, finite, clock)
            view = _act(action.run, action, view, result, clock)
      view = _checked(view, finite, clock)
      for action in actions:
        view = _act(action.end, action, view, result, clock)
  finally:
    for action in reversed(begun):
      action.close()
  result.state, result.step = view.state, view.step
  result.stopped_by, result.skipped_steps = view.stop_reason, view.skipped_steps
  return result


def _states_of(actions: Sequence[Action]) -> Callable[[], dict[str, Any]]:
  """`() -> {name: state}` of the actions that keep one (what a checkpoint saves)."""
  return lambda: {a.name: s for a in actions if (s := a.state_dict()) is not None}


def _act(method: Callable[[StepView], Produced | None], action: Action, view: StepView,
         result: FitResult, clock: LoopClock) -> StepView:
  """Runs one of an action's methods, timed by its category, and folds what it produced."""
  with clock.measure(action.time_category):
    return _fold(view, method(view), result)


def _call(advance: Advance, view: StepView, finite: FiniteCheck | None, clock: LoopClock, *,
          compiles: bool) -> StepView:
  """One compiled call; its `finite` flags are queued, and the call before it checked."""
  begin = time.perf_counter()
  with clock.measure("compile" if compiles else "train"):
    state, outputs, step, data_state = advance(view.state, view.step)
    if compiles:  # Its first run is one-time work too (collectives set up): wait for it here.
      jax.block_until_ready(outputs)
  if compiles:  # The first news of a run whose first log step may be minutes away.
    logging.info("Train step compiled: step %d of %d done in %.1f s (compiling included); "
                 "training on.", step, view.num_steps, time.perf_counter() - begin)
  if finite:
    with clock.measure("train"):  # Waits for the call before this one.
      finite.push(step, outputs["finite"])
  return dataclasses.replace(
      view, step=step, previous_step=view.step, state=state, outputs=outputs,
      eval_results=None, data_state=data_state, skipped_steps=finite.skipped if finite else 0,
      skipped_at=tuple(finite.skipped_at) if finite else ())


def _checked(view: StepView, finite: FiniteCheck | None, clock: LoopClock) -> StepView:
  """The view once every call's flags are checked (waiting for the last call)."""
  if not finite:
    return view
  with clock.measure("train"):  # Waits for the call.
    finite.settle()
  return dataclasses.replace(view, skipped_steps=finite.skipped,
                             skipped_at=tuple(finite.skipped_at))
