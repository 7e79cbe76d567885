"""The loop's side effects as actions: each sees an immutable view of the step and returns
what it produces.

After every compiled call the loop (`trainer.loop.driver`) runs, in order,
each action whose `triggers(view)` holds; after the last call, every action's
`end`. An action gets a `StepView` (the step, the state, the call's outputs,
this step's evaluation if one ran before it) and returns a `Produced` (eval
results, a stop request, a best value) or None. The loop folds what actions
produce into the view the next action sees and into the `FitResult`; actions
never write into shared state or look at each other.

Triggers fire when a step boundary is crossed: an action with
`every_steps=5` runs after a call that took the run from step 3 to step 6, so
a loop that advances several steps per call misses no boundary
(`StepView.crossed`).

The built-in actions, in `default_actions`' order:

1. `StopOnSignal` turns SIGTERM into a stop request at a step boundary.
2. `ReportMetrics` writes train scalars every `log_every_steps`.
3. `Evaluate` evaluates (each `Recipe.eval_variants`: the EMA parameters as `ema_*`).
4. `EarlyStopping` reads that evaluation and may request a stop.
5. `Checkpoint` saves periodically, at each evaluation when it keeps the best
   checkpoints by a metric, and at the end (so a stopped run is saved).
6. `Profile` traces a window of steps with `jax.profiler`.

A user adds an action without editing the Trainer: subclass `Action` and pass
it to `fit(..., actions=[...])` (it runs before `Checkpoint`, so a checkpoint
of step s holds its state after step s), or override
`Trainer.default_actions`. `PeriodicCallback` wraps a plain function. That no
action evaluates or saves a non-finite state is the loop's rule, whatever
the order.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
from clu import metric_writers

from trainer import metrics as metrics_lib
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
    outputs: the call's device outputs (`metrics`, `finite`), None before the first.
    eval_results: this step's evaluation, when an action before this one ran one.
    skipped_steps: non-finite updates left out so far (`nonfinite='skip'`).
    stop_reason: why the run stops after this step, once an action has asked.
    preempted: whether that stop came from a signal (nothing slow runs after it).
    eval_seconds: seconds spent evaluating in this run so far.
    data_state: the train data iterator's position after this step's batch.
    canonical: `tree -> host arrays` in the strategy-independent layout.
    action_states: `() -> {name: JSON state}` of the run's actions now.
  """

  step: int
  previous_step: int
  num_steps: int
  start_step: int
  state: Any
  outputs: PyTree = None
  eval_results: Mapping[str, float] | None = None
  skipped_steps: int = 0
  stop_reason: str | None = None
  preempted: bool = False
  eval_seconds: float = 0.0
  data_state: Any = None
  canonical: Callable[[PyTree], PyTree] = lambda tree: tree
  action_states: Callable[[], Mapping[str, Any]] = dict

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
  """

  eval_results: Mapping[str, float] | None = None
  eval_seconds: float = 0.0
  stop: str | None = None
  preempted: bool = False
  best: tuple[int, float] | None = None


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
  """

  state: Any
  step: int
  eval_history: list[tuple[int, dict[str, float]]] = dataclasses.field(default_factory=list)
  skipped_steps: int = 0
  stopped_by: str | None = None
  best: tuple[int, float] | None = None

  @property
  def final_eval(self) -> dict[str, float] | None:
    """The last evaluation's results, or None if none ran."""
    return self.eval_history[-1][1] if self.eval_history else None


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


class StopOnSignal(Action):
  """Requests a stop at the first step boundary after one of `signals` arrives.

  On one process a Python handler notes the signal. On a multi-process run
  (`jax.distributed`) a SIGTERM reaches one process, or several at different
  steps, so the processes must agree on where to stop: jax's preemption
  service (which catches SIGTERM itself) tells every process the same step,
  the first one all of them can still reach, and each stops there, so they
  save one checkpoint together. Outside the main thread (where Python cannot
  install handlers) a one-process run ignores signals.
  """

  def __init__(self, signals: Iterable[int] = (signal.SIGTERM,)):
    super().__init__(every_steps=1)
    self.signals = tuple(signals)
    self.received: int | None = None
    self._previous: dict[int, Any] = {}

  def _handle(self, signum, frame):
    del frame
    self.received = signum

  def begin(self, view: StepView) -> None:
    if jax.process_count() > 1:
      return  # The distributed runtime's handler must keep SIGTERM.
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in self.signals}

  def triggers(self, view: StepView) -> bool:
    return True

  def run(self, view: StepView) -> Produced | None:
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      if multihost_utils.reached_preemption_sync_point(view.step):
        self.received = signal.SIGTERM
    if self.received is None:
      return None
    return Produced(stop=signal.Signals(self.received).name, preempted=True)

  def close(self) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}


class ReportMetrics(Action):
  """Writes the mean train metrics, the learning rate and throughput every `every_steps`.

  Step metrics stay on device until a write; then they come to the host in
  one transfer and merge in numpy (`metrics_to_host`).

  Args:
    writer: where scalars go.
    metrics_to_host: the strategy's merge of several calls' metrics.
    learning_rate: `step -> rate` of the update from `step`, or None if unknown.
    batch_size: examples per step, for examples/s.
    counts_skipped: whether to report `train/skipped_steps` (`nonfinite='skip'`).
  """

  def __init__(self, writer: metric_writers.MetricWriter, *, every_steps: int,
               metrics_to_host: Callable[[list], Any],
               learning_rate: Callable[[int], float | None], batch_size: int,
               counts_skipped: bool = False):
    super().__init__(every_steps=every_steps)
    self.writer, self.metrics_to_host = writer, metrics_to_host
    self.learning_rate, self.batch_size = learning_rate, batch_size
    self.counts_skipped = counts_skipped
    self._pending: list[PyTree] = []
    self._tick = self._eval_seconds = 0.0
    self._last_step = 0

  def triggers(self, view: StepView) -> bool:
    return True  # Collects every call's metrics; writes every `every_steps`.

  def needs_checked_step(self, view: StepView) -> bool:
    # A write reports `skipped_steps`, which must count this step.
    return self.counts_skipped and bool(view.crossed(self.every_steps))

  def begin(self, view: StepView) -> None:
    self._tick, self._eval_seconds = time.perf_counter(), view.eval_seconds
    self._last_step = view.step

  def run(self, view: StepView) -> None:
    self._pending.append(view.outputs["metrics"])
    if view.crossed(self.every_steps):
      self._write(view)

  def end(self, view: StepView) -> None:
    if self._pending:
      self._write(view)

  def _write(self, view: StepView) -> None:
    step = view.step
    merged = self.metrics_to_host(self._pending)
    scalars = {f"train/{k}": v for k, v in metrics_lib.scalars(merged).items()}
    lr = self.learning_rate(step - 1)  # The rate of this step's update.
    if lr is not None:
      scalars["train/learning_rate"] = lr
    seconds = (time.perf_counter() - self._tick) - (view.eval_seconds - self._eval_seconds)
    steps_per_sec = (step - self._last_step) / max(seconds, 1e-9)
    examples_per_sec = steps_per_sec * self.batch_size
    eta = (view.num_steps - step) / max(steps_per_sec, 1e-9)
    logging.info("step %d/%d: %.2f steps/s, %.0f examples/s, ETA %dm%02ds", step,
                 view.num_steps, steps_per_sec, examples_per_sec, eta // 60, eta % 60)
    scalars.update({"train/steps_per_sec": steps_per_sec,
                    "train/examples_per_sec": examples_per_sec})
    if self.counts_skipped:
      scalars["train/skipped_steps"] = view.skipped_steps
    self.writer.write_scalars(step, scalars)
    self._pending = []
    self._tick, self._eval_seconds = time.perf_counter(), view.eval_seconds
    self._last_step = step


class Evaluate(Action):
  """Evaluates every `every_steps` and at the last step, each variant of the state.

  Args:
    writer: where `eval/<name>` scalars go.
    evaluate: `(state, batches) -> results`.
    eval_batches: returns a fresh iterable of eval batches per evaluation.
    variants: `state -> {prefix: state}` (`Recipe.eval_variants`: `ema_` for EMA).

  Once a signal has stopped the run (preemption), it does not evaluate: the
  checkpoint comes first.
  """

  reads_state = True

  def __init__(self, writer: metric_writers.MetricWriter,
               evaluate: Callable[[Any, Iterable[Batch]], dict[str, float]],
               eval_batches: Callable[[], Iterable[Batch]], *, every_steps: int,
               variants: Callable[[Any], Mapping[str, Any]] = lambda state: {"": state}):
    super().__init__(every_steps=every_steps)
    self.writer, self.evaluate, self.eval_batches = writer, evaluate, eval_batches
    self.variants = variants
    self._last: int | None = None

  def triggers(self, view: StepView) -> bool:
    return super().triggers(view) and not view.preempted

  def run(self, view: StepView) -> Produced:
    start = time.perf_counter()
    results = {}
    for prefix, state in self.variants(view.state).items():
      results.update({f"{prefix}{k}": v
                      for k, v in self.evaluate(state, self.eval_batches()).items()})
    self.writer.write_scalars(view.step, {f"eval/{k}": v for k, v in results.items()})
    self._last = view.step
    return Produced(eval_results=results, eval_seconds=time.perf_counter() - start)

  def end(self, view: StepView) -> Produced | None:
    if view.is_last and self._last != view.step and not view.preempted:
      return self.run(view)
    return None


class EarlyStopping(Action):
  """Stops when `metric` has not improved by `min_delta` for `patience` evaluations.

  Runs right after `Evaluate` (with its schedule). The best value and the
  count of evaluations without improvement are saved with checkpoints, so a
  resumed run continues the count, and a run that stopped early stays stopped.
  """

  def __init__(self, metric: str, *, mode: str, patience: int, min_delta: float,
               every_steps: int):
    if mode not in ("min", "max"):
      raise ValueError(f"config.early_stopping.mode={mode!r} must be 'min' or 'max'.")
    if not isinstance(patience, int) or patience < 1:
      raise ValueError(f"config.early_stopping.patience={patience!r} must be an integer >= 1 "
                       f"(evaluations without improvement before stopping).")
    if not every_steps:
      raise ValueError(
          f"config.early_stopping.metric={metric!r} needs periodic evaluations, but "
          f"config.eval_every_steps={every_steps!r}; set it to a positive step count.")
    super().__init__(every_steps=every_steps)
    self.metric, self.mode, self.patience, self.min_delta = metric, mode, patience, min_delta
    self.best: float | None = None
    self.best_step: int | None = None
    self.bad_evals = 0
    self.stopped = False

  def begin(self, view: StepView) -> Produced | None:
    if self.stopped:  # A resumed run that had stopped stays stopped.
      return Produced(stop="early_stopping")
    return None

  def run(self, view: StepView) -> Produced | None:
    results = view.eval_results
    if results is None:
      return None
    if self.metric not in results:
      raise ValueError(f"config.early_stopping.metric={self.metric!r} is not an eval metric; "
                       f"the eval metrics are {sorted(results)}.")
    value = float(results[self.metric])
    sign = 1.0 if self.mode == "max" else -1.0
    if self.best is None or sign * (value - self.best) > self.min_delta:
      self.best, self.best_step, self.bad_evals = value, view.step, 0
    else:
      self.bad_evals += 1
    stop = None
    if self.bad_evals >= self.patience and not view.is_last:
      self.stopped, stop = True, "early_stopping"
    return Produced(best=(self.best_step, self.best), stop=stop)

  def state_dict(self) -> dict[str, Any]:
    return {"best": self.best, "best_step": self.best_step, "bad_evals": self.bad_evals,
            "stopped": self.stopped}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    self.best, self.best_step = state["best"], state["best_step"]
    self.bad_evals, self.stopped = state["bad_evals"], state["stopped"]


class Checkpoint(Action):
  """Saves the run every `every_steps`, at evaluations when it keeps the best, and at the end.

  Args:
    save: starts an asynchronous save of a `RunState`.
    wait: blocks until the last save is on disk.
    step_dir: `step -> directory`, for the log line at a stop.
    every_steps: the periodic schedule (0: only at the end and at a stop).
    eval_every_steps: also save at each evaluation (best-checkpoint ranking).

  A checkpoint saved at an evaluation carries its results, which is what a
  best-checkpoint policy ranks by. At a stop (SIGTERM, early stopping) the
  save is waited for before `fit` returns.
  """

  reads_state = True

  def __init__(self, save: Callable[[Any], None], *, wait: Callable[[], None],
               step_dir: Callable[[int], str], every_steps: int, eval_every_steps: int = 0):
    super().__init__(every_steps=every_steps)
    self.save, self.wait, self.step_dir = save, wait, step_dir
    self.eval_every_steps = eval_every_steps
    self._last: int | None = None

  def triggers(self, view: StepView) -> bool:
    return super().triggers(view) or bool(view.crossed(self.eval_every_steps))

  def run(self, view: StepView) -> None:
    self.save(view.run_state())
    self._last = view.step

  def end(self, view: StepView) -> None:
    if self._last != view.step and view.step > view.start_step:
      self.run(view)
    if view.stop_reason is not None:
      self.wait()
      logging.warning("Stopped by %s at step %d of %d; checkpoint written to %s",
                      view.stop_reason, view.step, view.num_steps, self.step_dir(view.step))


class Profile(Action):
  """Traces steps `first_step + 1 .. first_step + num_steps` with `jax.profiler` into `logdir`.

  The trace (`plugins/profile/<run>/*.xplane.pb`) opens in TensorBoard's
  profile plugin or in Perfetto (ui.perfetto.dev).
  """

  def __init__(self, logdir: str, *, first_step: int, num_steps: int):
    if not isinstance(first_step, int) or first_step < 0:
      raise ValueError(f"config.profile.first_step={first_step!r} must be an integer >= 0.")
    if not isinstance(num_steps, int) or num_steps < 1:
      raise ValueError(f"config.profile.num_steps={num_steps!r} must be an integer >= 1 "
                       f"(0 in the config: no profile).")
    super().__init__(every_steps=0)
    self.logdir, self.first_step, self.num_steps = logdir, first_step, num_steps
    self._running = False

  def _crossed(self, view: StepView, step: int) -> bool:
    return view.previous_step < step <= view.step

  def triggers(self, view: StepView) -> bool:
    return (self._crossed(view, self.first_step)
            or self._crossed(view, self.first_step + self.num_steps))

  def begin(self, view: StepView) -> None:
    if view.step == self.first_step:
      self._start(view)

  def run(self, view: StepView) -> None:
    if not self._running and self._crossed(view, self.first_step):
      self._start(view)
    elif self._running:
      self._stop(view.state)

  def _start(self, view: StepView) -> None:
    jax.block_until_ready(view.state)  # Earlier steps stay out of the trace.
    jax.profiler.start_trace(self.logdir)
    self._running = True
    logging.info("Profiling steps %d-%d into %s", self.first_step + 1,
                 self.first_step + self.num_steps, self.logdir)

  def _stop(self, state) -> None:
    jax.block_until_ready(state)
    jax.profiler.stop_trace()
    self._running = False

  def end(self, view: StepView) -> None:
    if self._running:  # The run ended inside the window.
      self._stop(view.state)

  def close(self) -> None:
    if self._running:  # An error ended the run: its state may be gone.
      jax.profiler.stop_trace()
      self._running = False


def with_user_actions(defaults: list[Action], user: list[Action]) -> list[Action]:
  """`user` inserted before the first `Checkpoint` of `defaults` (else at the end).

  Then a checkpoint of step s holds the user actions' state after step s.

  Raises:
    ValueError: two actions that save state share a name (their states would collide).
  """
  at = next((i for i, a in enumerate(defaults) if isinstance(a, Checkpoint)), len(defaults))
  actions = [*defaults[:at], *user, *defaults[at:]]
  names = [a.name for a in actions if a.state_dict() is not None]
  dup = {n for n in names if names.count(n) > 1}
  if dup:
    raise ValueError(f"actions {sorted(dup)} appear twice and both save state; give one a "
                     f"different `name`.")
  return actions


__all__ = ["Action", "Checkpoint", "EarlyStopping", "Evaluate", "FitResult",
           "PeriodicCallback", "Produced", "Profile", "ReportMetrics", "StepView",
           "StopOnSignal", "with_user_actions"]
