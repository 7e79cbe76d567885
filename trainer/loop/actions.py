"""The loop's side effects as actions: what an action sees, what it returns, and its base class.

After every compiled call the loop (`trainer.loop.driver`) runs, in order,
each action whose `triggers(view)` holds; after the last call, every action's
`end`. An action gets a `StepView` (the step, the state, the call's outputs,
this step's evaluation if one ran before it) and returns a `Produced` (eval
results, a stop request, a best value, a replaced state) or None. The loop folds what actions
produce into the view the next action sees and into the `FitResult`; actions
never write into shared state or look at each other.

Triggers fire when a step boundary is crossed: an action with
`every_steps=5` runs after a call that took the run from step 3 to step 6, so
a loop that advances several steps per call misses no boundary
(`StepView.crossed`). An action that needs the state of its exact step says
so with `next_boundary`, and a call of several steps ends there
(`trainer.loop.chunks`). The built-in actions are in `trainer.loop.builtin`.

A user adds an action without editing the Trainer: subclass `Action` and pass
it to `fit(..., actions=[...])` (it runs before the built-in `Checkpoint`, so
a checkpoint of step s holds its state after step s), or override
`Trainer.default_actions`. `PeriodicCallback` wraps a plain function. That no
action evaluates or saves a non-finite state is the loop's rule, whatever
the order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from trainer.checkpoint import RunState

Batch = Mapping[str, Any]
PyTree = Any


@dataclasses.dataclass(frozen=True)
class StepView:
  """What an action sees after a compiled call: read-only.

  Attributes:
    step: the number of updates done (`state.step`).
    previous_step: the step before this call (`step - k` for k steps a call).
    num_steps: the step the run ends at.
    start_step: the step this run started (or resumed) at.
    state: the train state after `step` (device arrays, possibly still computing).
    outputs: the call's device outputs (`metrics`, `finite`), None before the first;
      for a call of several steps, each step's, stacked on `steps_axis`.
    steps_axis: where `outputs` hold the call's steps (`Strategy.steps_axis`), or
      None where a call runs one step and its outputs have no step axis.
    eval_results: this step's evaluation, when an action before this one ran one.
    skipped_steps: non-finite updates left out so far (`nonfinite='skip'`).
    skipped_at: the steps of those updates (checked ones only, as `skipped_steps`).
    stop_reason: why the run stops after this step, once an action has asked.
    preempted: whether that stop came from a signal (nothing slow runs after it).
    eval_seconds: seconds spent evaluating in this run so far.
    data_state: the train data iterator's position after this step's batch.
    canonical: `tree -> host arrays` in the strategy-independent layout.
    action_states: `() -> {name: JSON state}` of the run's actions now.
    flops: the train step's FLOPs (`trainer.throughput.StepFlops`, counted when
      first asked), or None where the run did not count them.
    tokens_per_step: tokens in one global batch (language models), else None.
  """

  step: int
  previous_step: int
  num_steps: int
  start_step: int
  state: Any
  outputs: PyTree = None
  steps_axis: int | None = None
  eval_results: Mapping[str, float] | None = None
  skipped_steps: int = 0
  skipped_at: tuple[int, ...] = ()
  stop_reason: str | None = None
  preempted: bool = False
  eval_seconds: float = 0.0
  data_state: Any = None
  canonical: Callable[[PyTree], PyTree] = lambda tree: tree
  action_states: Callable[[], Mapping[str, Any]] = lambda: {}
  flops: Any = None
  tokens_per_step: int | None = None

  def run_state(self) -> RunState:
    """What a checkpoint of this step saves: state, data position, action states, eval."""
    return RunState(self.state, self.step, data=self.data_state,
                    actions=self.action_states(), metrics=self.eval_results)

  def crossed(self, every_steps: int) -> list[int]:
    """The multiples of `every_steps` in `(previous_step, step]` (none for 0)."""
    if not every_steps:
      return []
    first = (self.previous_step // every_steps + 1) * every_steps
    return list(range(first, self.step + 1, every_steps))

  @property
  def is_last(self) -> bool:
    return self.step >= self.num_steps


@dataclasses.dataclass(frozen=True)
class Produced:
  """What an action returns; the loop folds it into the next view and the `FitResult`.

  Attributes:
    eval_results: an evaluation's results at this step.
    eval_seconds: seconds that evaluation took (left out of throughput figures).
    stop: a reason to end the run after this step.
    preempted: the stop comes from a signal.
    best: `(step, value)` of the best evaluation so far by a tracked metric.
    state: a new train state to go on from (a sweep's scheduler refilled or copied
      members): the same structure, shapes and placement, so nothing recompiles.
  """

  eval_results: Mapping[str, float] | None = None
  eval_seconds: float = 0.0
  stop: str | None = None
  preempted: bool = False
  best: tuple[int, float] | None = None
  state: Any = None


@dataclasses.dataclass
class FitResult:
  """What `Trainer.fit` returns; assembled by the loop.

  Attributes:
    state: the final train state.
    step: the step the run ended at.
    eval_history: `(step, results)` of every evaluation of this run, oldest first.
    skipped_steps: updates `nonfinite='skip'` left out in this run.
    stopped_by: why the run ended before `num_steps` ('SIGTERM', 'early_stopping',
      or the reason an action gave), else None.
    best: `(step, value)` of the best evaluation by the early-stopping metric, if any.
    step_flops: the train step's FLOPs (`trainer.throughput.StepFlops`: per model
      and per device), as the run counted them for `train/mfu`.
  """

  state: Any
  step: int
  eval_history: list[tuple[int, dict[str, float]]] = dataclasses.field(default_factory=list)
  skipped_steps: int = 0
  stopped_by: str | None = None
  best: tuple[int, float] | None = None
  step_flops: Any = None

  @property
  def final_eval(self) -> dict[str, float] | None:
    """The last evaluation's results, or None if none ran."""
    return self.eval_history[-1][1] if self.eval_history else None


def next_multiple(step: int, every_steps: int) -> int | None:
  """The first multiple of `every_steps` after `step` (None for 0: never)."""
  return (step // every_steps + 1) * every_steps if every_steps else None


class Action:
  """A side effect of the training loop.

  Override `run` (and `triggers` for a schedule other than every
  `every_steps` steps); `begin`, `end` and `close` are optional. An action
  whose `run` reads the state's values (evaluates it, saves it) sets
  `reads_state`: the loop then checks the step's loss and gradient norm
  before it runs (`needs_checked_step` refines when). An action with
  something to remember across a restart returns it from `state_dict`
  (JSON); it is saved with each checkpoint and given back to
  `load_state_dict` on resume.
  """

  #: Whether `run` reads the state's values (the loop checks the step first).
  reads_state: bool = False
  #: Where the loop accounts this action's time (`trainer.loop.timing.CATEGORIES`).
  time_category: str = "other"

  def __init__(self, *, every_steps: int = 1):
    if not isinstance(every_steps, int) or every_steps < 0:
      raise ValueError(f"{type(self).__name__}(every_steps={every_steps!r}) must be an "
                       f"integer >= 0 (0: never periodically).")
    self.every_steps = every_steps

  @property
  def name(self) -> str:
    return type(self).__name__

  def triggers(self, view: StepView) -> bool:
    """Whether `run` runs after this call: when it crossed a multiple of `every_steps`."""
    return bool(view.crossed(self.every_steps))

  def next_boundary(self, step: int) -> int | None:
    """The first step after `step` at which `run` needs the loop to stop with the state
    (a call of several steps ends there), or None: by default the next multiple of
    `every_steps`. An action that overrides `triggers` overrides this too; one that
    reads only `outputs` (each step's, stacked) returns None."""
    return next_multiple(step, self.every_steps)

  def needs_checked_step(self, view: StepView) -> bool:
    """Whether the step must be known finite before `run`: by default, when it
    `reads_state` (it triggers, or `run` would not be asked)."""
    return self.reads_state

  def begin(self, view: StepView) -> Produced | None:
    """Before the first call of the run."""

  def run(self, view: StepView) -> Produced | None:
    """After a call at which `triggers` holds."""

  def end(self, view: StepView) -> Produced | None:
    """After the last call (the run finished, or stopped at a requested stop)."""

  def close(self) -> None:
    """Always last, also after an error: release what `begin` took."""

  def state_dict(self) -> dict[str, Any] | None:
    """JSON-serialisable state to keep in checkpoints, or None."""
    return None

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Takes back what `state_dict` returned, when a run resumes."""


class PeriodicCallback(Action):
  """Calls `callback(view)` every `every_steps` steps (and at the end with `at_end`)."""

  def __init__(self, callback: Callable[[StepView], Any], *, every_steps: int,
               at_end: bool = False, reads_state: bool = False):
    super().__init__(every_steps=every_steps)
    self.callback, self.at_end, self.reads_state = callback, at_end, reads_state
    self._last: int | None = None

  def run(self, view: StepView) -> None:
    self.callback(view)
    self._last = view.step

  def end(self, view: StepView) -> None:
    if self.at_end and self._last != view.step:
      self.run(view)


__all__ = ["Action", "FitResult", "PeriodicCallback", "Produced", "StepView", "next_multiple"]
