"""The loop's side effects as actions: each says when it runs, their order states the rules.

`Trainer.fit` is a short driver: it runs a compiled train step, then, after
every step, each action in `loop.actions` whose `triggers(loop)` holds, in
order; after the last step (the run's end, or a stop an action requested)
every action's `end`, in order. The order is the contract:

1. `StopOnSignal` turns SIGTERM into a stop request at a step boundary.
2. `FiniteGuard` checks that the step's loss and gradient norm were finite.
   It keeps one step in flight, checking the previous step's flag, and checks
   the current one whenever a later action that `reads_state` runs at this
   step (and at the end): so no later action ever evaluates or saves a
   non-finite state.
3. `ReportMetrics` writes train scalars every `log_every_steps`.
4. `Evaluate` evaluates (the EMA parameters too, as `ema_*`).
5. `EarlyStopping` reads that evaluation and may request a stop.
6. `Checkpoint` saves periodically, at each evaluation when it keeps the best
   checkpoints by a metric, and at the end (so a stopped run is saved).
7. `Profile` traces a window of steps with `jax.profiler`.

A user adds an action without editing the Trainer: subclass `Action` and pass
it to `fit(..., actions=[...])` (it runs after the guard, logging, evaluation
and early stopping, and before `Checkpoint`, so a checkpoint of step s holds
its state after step s), or override
`Trainer.default_actions` to reorder them. `PeriodicCallback` wraps a plain
function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from clu import metric_writers

from strategies.base import to_host
from trainer import metrics as metrics_lib
from trainer.checkpoint import Checkpointer

if TYPE_CHECKING:
  from trainer.trainer import Trainer

Batch = Mapping[str, Any]
PyTree = Any


class NonFiniteError(FloatingPointError):
  """A train step produced a non-finite loss or gradient norm under `nonfinite='stop'`."""


@dataclasses.dataclass
class FitResult:
  """What `Trainer.fit` returns.

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


@dataclasses.dataclass
class Loop:
  """What actions read and change: the run's position, its state, and the stop request.

  Attributes:
    trainer: the Trainer running the loop.
    state: the train state after `step` (device arrays, possibly still computing).
    step: the number of updates done (`state.step`).
    num_steps: the step the run ends at.
    start_step: the step this run started (or resumed) at.
    outputs: the last train step's device outputs (`metrics`, `finite`).
    eval_results: results of an evaluation at this step, set by `Evaluate`.
    actions: the actions of this run, in order.
    writer: where scalars go.
    checkpointer: the run's checkpointer, or None.
    result: the `FitResult` being built.
    stop_reason: why the run stops early, once an action has asked.
  """

  trainer: Trainer
  state: Any
  step: int
  num_steps: int
  start_step: int
  actions: list[Action]
  writer: metric_writers.MetricWriter
  checkpointer: Checkpointer | None = None
  outputs: PyTree = None
  eval_results: dict[str, float] | None = None
  stop_reason: str | None = None
  #: Whether the stop came from a signal (preemption): nothing slow runs after it.
  preempted: bool = False
  result: FitResult | None = None
  #: Seconds spent in evaluations, which throughput figures leave out.
  eval_seconds: float = 0.0
  #: The data iterator's position after the batch of the last step (checkpointable
  #: iterators only, e.g. Grain's), saved with each checkpoint.
  data_state: Any = None

  def request_stop(self, reason: str) -> None:
    """Ends the run after this step's actions; `end` then runs (a checkpoint is saved)."""
    if self.stop_reason is None:
      logging.info("Stop requested at step %d: %s", self.step, reason)
      self.stop_reason = reason

  def later_actions(self, action: Action) -> list[Action]:
    """The actions after `action` in the run's order."""
    return self.actions[self.actions.index(action) + 1:]

  def run_step_actions(self) -> None:
    """Runs, in order, each action that triggers at `step`."""
    self.eval_results = None
    for action in self.actions:
      if action.triggers(self):
        action.run(self)

  @contextlib.contextmanager
  def running(self):
    """`begin` of every action on entry; on a clean exit `end` of each; `close` always."""
    begun = []
    try:
      for action in self.actions:
        action.begin(self)
        begun.append(action)
      yield self
      for action in self.actions:
        action.end(self)
    finally:
      for action in reversed(begun):
        action.close(self)


class Action:
  """A side effect of the training loop.

  Override `run` (and `triggers` for a schedule other than every
  `every_steps` steps); `begin`, `end` and `close` are optional. An action
  whose `run` reads the state's values (evaluates it, saves it) sets
  `reads_state`, so `FiniteGuard` checks the step before it
  (`needs_checked_step` refines when). An action with
  something to remember across a restart returns it from `state_dict` (JSON);
  it is saved with each checkpoint and given back to `load_state_dict` on resume.
  """

  #: Whether `run` reads the state's values (the guard settles the step first).
  reads_state: bool = False

  def __init__(self, *, every_steps: int = 1):
    if not isinstance(every_steps, int) or every_steps < 0:
      raise ValueError(f"{type(self).__name__}(every_steps={every_steps!r}) must be an "
                       f"integer >= 0 (0: never periodically).")
    self.every_steps = every_steps

  @property
  def name(self) -> str:
    return type(self).__name__

  def triggers(self, loop: Loop) -> bool:
    """Whether `run` runs after this step: every `every_steps` steps by default."""
    return bool(self.every_steps) and loop.step % self.every_steps == 0

  def needs_checked_step(self, loop: Loop) -> bool:
    """Whether the guard must check this step before this action runs: by default,
    when it `reads_state` and triggers."""
    return self.reads_state and self.triggers(loop)

  def begin(self, loop: Loop) -> None:
    """Before the first step of the run."""

  def run(self, loop: Loop) -> None:
    """After a step at which `triggers` holds."""

  def end(self, loop: Loop) -> None:
    """After the last step (the run finished, or stopped at a requested stop)."""

  def close(self, loop: Loop) -> None:
    """Always last, also after an error: release what `begin` took."""

  def state_dict(self) -> dict[str, Any] | None:
    """JSON-serialisable state to keep in checkpoints, or None."""
    return None

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Takes back what `state_dict` returned, when a run resumes."""


class PeriodicCallback(Action):
  """Calls `callback(loop)` every `every_steps` steps (and at the end with `at_end`)."""

  def __init__(self, callback: Callable[[Loop], Any], *, every_steps: int, at_end: bool = False,
               reads_state: bool = False):
    super().__init__(every_steps=every_steps)
    self.callback, self.at_end, self.reads_state = callback, at_end, reads_state
    self._last: int | None = None

  def run(self, loop: Loop) -> None:
    self.callback(loop)
    self._last = loop.step

  def end(self, loop: Loop) -> None:
    if self.at_end and self._last != loop.step:
      self.run(loop)


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

  def begin(self, loop: Loop) -> None:
    if jax.process_count() > 1:
      return  # The distributed runtime's handler must keep SIGTERM.
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in self.signals}

  def run(self, loop: Loop) -> None:
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      if multihost_utils.reached_preemption_sync_point(loop.step):
        self.received = signal.SIGTERM
    if self.received is not None:
      loop.request_stop(signal.Signals(self.received).name)
      loop.preempted = True

  def close(self, loop: Loop) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}


class FiniteGuard(Action):
  """Checks each step's `finite` flag: raises (`nonfinite='stop'`) or counts (`'skip'`).

  The flag of step s is read after step s+1 is queued, so the host never
  waits for a step to finish, except at a step where a later action reads
  the state (`reads_state`) and at the end: then it waits and checks step s.
  """

  def __init__(self, policy: str):
    super().__init__(every_steps=1)
    self.policy = policy
    self._unchecked: list[tuple[int, jax.Array]] = []

  def _settle(self, loop: Loop) -> None:
    while self._unchecked:
      self._check(loop, *self._unchecked.pop())

  def run(self, loop: Loop) -> None:
    self._settle(loop)  # The previous step's flag; this step is still in flight.
    self._unchecked.append((loop.step, loop.outputs["finite"]))
    if any(a.needs_checked_step(loop) for a in loop.later_actions(self)):
      self._settle(loop)

  def end(self, loop: Loop) -> None:
    self._settle(loop)

  def _check(self, loop: Loop, step: int, finite: jax.Array) -> None:
    ok = np.ravel(to_host(finite))  # Per replica or per member.
    if ok.all():
      return
    strategy = loop.trainer.strategy
    members = (f" (ensemble member(s) {np.flatnonzero(~ok).tolist()})"
               if strategy.is_ensemble else "")
    if self.policy == "skip":
      loop.result.skipped_steps += 1
      logging.warning("Step %d%s: non-finite loss or gradient norm; update skipped "
                      "(%d so far)", step, members, loop.result.skipped_steps)
      return
    checkpointer = loop.checkpointer
    if checkpointer:
      checkpointer.wait()  # The last save (of a finite state) completes first.
    latest = checkpointer.latest_step() if checkpointer else None
    saved = (f"the latest checkpoint is step {latest} in {checkpointer.directory}"
             if latest is not None else "no checkpoint was written")
    raise NonFiniteError(
        f"step {step}{members}: the loss or the gradient norm is not finite, so training "
        f"stopped (config.nonfinite='stop'; 'skip' would leave such updates out); "
        f"{saved}.")


class ReportMetrics(Action):
  """Writes the mean train metrics, the learning rate and throughput every `every_steps`.

  Step metrics stay on device until a write; then they come to the host in
  one transfer and merge in numpy (`Strategy.metrics_to_host`).
  """

  def __init__(self, *, every_steps: int):
    super().__init__(every_steps=every_steps)
    self._pending: list[PyTree] = []
    self._tick = self._eval_seconds = 0.0

  def triggers(self, loop: Loop) -> bool:
    return True  # Collects every step's metrics; writes every `every_steps`.

  def needs_checked_step(self, loop: Loop) -> bool:
    # A write reports `skipped_steps`, which must count this step.
    return (loop.trainer.nonfinite == "skip" and bool(self.every_steps)
            and loop.step % self.every_steps == 0)

  def begin(self, loop: Loop) -> None:
    self._tick, self._eval_seconds = time.perf_counter(), loop.eval_seconds

  def run(self, loop: Loop) -> None:
    self._pending.append(loop.outputs["metrics"])
    if self.every_steps and loop.step % self.every_steps == 0:
      self._write(loop)

  def end(self, loop: Loop) -> None:
    if self._pending:
      self._write(loop)

  def _write(self, loop: Loop) -> None:
    trainer, step = loop.trainer, loop.step
    merged = trainer.strategy.metrics_to_host(self._pending)
    scalars = {f"train/{k}": v for k, v in metrics_lib.scalars(merged).items()}
    lr = trainer.learning_rate(step - 1)  # The rate of this step's update.
    if lr is not None:
      scalars["train/learning_rate"] = lr
    seconds = (time.perf_counter() - self._tick) - (loop.eval_seconds - self._eval_seconds)
    steps_per_sec = len(self._pending) / max(seconds, 1e-9)
    examples_per_sec = steps_per_sec * trainer.config.batch_size
    eta = (loop.num_steps - step) / steps_per_sec
    logging.info("step %d/%d: %.2f steps/s, %.0f examples/s, ETA %dm%02ds", step,
                 loop.num_steps, steps_per_sec, examples_per_sec, eta // 60, eta % 60)
    scalars.update({"train/steps_per_sec": steps_per_sec,
                    "train/examples_per_sec": examples_per_sec})
    if trainer.nonfinite == "skip":
      scalars["train/skipped_steps"] = loop.result.skipped_steps
    loop.writer.write_scalars(step, scalars)
    self._pending = []
    self._tick, self._eval_seconds = time.perf_counter(), loop.eval_seconds


class Evaluate(Action):
  """Evaluates every `every_steps` and at the last step; the EMA parameters too (`ema_*`).

  Results go to the writer as `eval/<name>`, to `loop.eval_results` for the
  actions after it, and to the run's `eval_history`. Once a signal has
  stopped the run (preemption), it does not evaluate: the checkpoint comes first.
  """

  reads_state = True

  def __init__(self, eval_batches: Callable[[], Iterable[Batch]], *, every_steps: int):
    super().__init__(every_steps=every_steps)
    self.eval_batches = eval_batches
    self._last: int | None = None

  def triggers(self, loop: Loop) -> bool:
    return super().triggers(loop) and not loop.preempted

  def run(self, loop: Loop) -> None:
    start = time.perf_counter()
    trainer, state = loop.trainer, loop.state
    results = trainer.evaluate(state, self.eval_batches())
    ema = getattr(state, "ema_params", None)
    if ema is not None:
      ema_results = trainer.evaluate(state.replace(params=ema), self.eval_batches())
      results.update({f"ema_{k}": v for k, v in ema_results.items()})
    loop.eval_results = results
    loop.result.eval_history.append((loop.step, results))
    loop.writer.write_scalars(loop.step, {f"eval/{k}": v for k, v in results.items()})
    self._last = loop.step
    loop.eval_seconds += time.perf_counter() - start

  def end(self, loop: Loop) -> None:
    if loop.step == loop.num_steps and self._last != loop.step and not loop.preempted:
      self.run(loop)


class EarlyStopping(Action):
  """Stops when `metric` has not improved by `min_delta` for `patience` evaluations.

  Runs right after `Evaluate` (with its schedule). The best value and the
  count of evaluations without improvement are saved with checkpoints, so a
  resumed run continues the count, and a run that stopped early stays stopped.
  """

  reads_state = True

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

  def begin(self, loop: Loop) -> None:
    if self.stopped:
      loop.request_stop("early_stopping")  # A resumed run that had stopped stays stopped.

  def run(self, loop: Loop) -> None:
    results = loop.eval_results
    if results is None:
      return
    if self.metric not in results:
      raise ValueError(f"config.early_stopping.metric={self.metric!r} is not an eval metric; "
                       f"the eval metrics are {sorted(results)}.")
    value = float(results[self.metric])
    sign = 1.0 if self.mode == "max" else -1.0
    if self.best is None or sign * (value - self.best) > self.min_delta:
      self.best, self.best_step, self.bad_evals = value, loop.step, 0
    else:
      self.bad_evals += 1
    loop.result.best = (self.best_step, self.best)
    if self.bad_evals >= self.patience and loop.step < loop.num_steps:
      self.stopped = True
      loop.request_stop("early_stopping")

  def state_dict(self) -> dict[str, Any]:
    return {"best": self.best, "best_step": self.best_step, "bad_evals": self.bad_evals,
            "stopped": self.stopped}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    self.best, self.best_step = state["best"], state["best_step"]
    self.bad_evals, self.stopped = state["bad_evals"], state["stopped"]


class Checkpoint(Action):
  """Saves every `checkpointer.every_steps`, at evaluations when it keeps the best, and at the end.

  A checkpoint saved at an evaluation carries its results as orbax metrics,
  which is what `checkpointer.best_metric` ranks by. The JSON state of every
  action (`Action.state_dict`) is saved beside the train state. At a stop
  (SIGTERM, early stopping) the save is waited for before `fit` returns.
  """

  reads_state = True

  def __init__(self, checkpointer: Checkpointer, *, eval_every_steps: int = 0):
    super().__init__(every_steps=checkpointer.every_steps)
    self.checkpointer = checkpointer
    self.eval_every_steps = eval_every_steps if checkpointer.best_metric else 0
    self._last: int | None = None

  def triggers(self, loop: Loop) -> bool:
    return super().triggers(loop) or (
        bool(self.eval_every_steps) and loop.step % self.eval_every_steps == 0)

  def run(self, loop: Loop) -> None:
    states = {a.name: s for a in loop.actions if (s := a.state_dict()) is not None}
    loop.trainer.save_checkpoint(self.checkpointer, loop.state, loop.step,
                                 metrics=loop.eval_results, action_states=states,
                                 data_state=loop.data_state)
    self._last = loop.step

  def end(self, loop: Loop) -> None:
    if self._last != loop.step and loop.step > loop.start_step:
      self.run(loop)
    if loop.stop_reason is not None:
      self.checkpointer.wait()
      logging.warning("Stopped by %s at step %d of %d; checkpoint written to %s",
                      loop.stop_reason, loop.step, loop.num_steps,
                      self.checkpointer.step_dir(loop.step))


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

  def triggers(self, loop: Loop) -> bool:
    return loop.step in (self.first_step, self.first_step + self.num_steps)

  def begin(self, loop: Loop) -> None:
    if loop.step == self.first_step:
      self.run(loop)

  def run(self, loop: Loop) -> None:
    if not self._running and loop.step == self.first_step:
      jax.block_until_ready(loop.state)  # Earlier steps stay out of the trace.
      jax.profiler.start_trace(self.logdir)
      self._running = True
      logging.info("Profiling steps %d-%d into %s", self.first_step + 1,
                   self.first_step + self.num_steps, self.logdir)
    elif self._running:
      self._stop(loop)

  def _stop(self, loop: Loop) -> None:
    jax.block_until_ready(loop.state)
    jax.profiler.stop_trace()
    self._running = False

  def close(self, loop: Loop) -> None:
    if self._running:
      self._stop(loop)


def default_actions(trainer: Trainer, *, checkpointer: Checkpointer | None,
                    eval_batches: Callable[[], Iterable[Batch]] | None,
                    workdir: str | None) -> list[Action]:
  """The built-in actions `config` asks for, in the order that states the loop's rules.

  Raises:
    ValueError: an early-stopping or profile setting that cannot work (before any step).
  """
  config = trainer.config
  eval_every = config.get("eval_every_steps", 0)
  actions: list[Action] = []
  if checkpointer:
    actions.append(StopOnSignal())
  actions.append(FiniteGuard(trainer.nonfinite))
  actions.append(ReportMetrics(every_steps=config.get("log_every_steps", 100)))
  if eval_batches is not None:
    actions.append(Evaluate(eval_batches, every_steps=eval_every))
  early = config.get("early_stopping")
  if early is not None and early.get("metric"):
    if eval_batches is None:
      raise ValueError(f"config.early_stopping.metric={early.metric!r} needs eval batches; "
                       f"fit() got eval_batches=None.")
    actions.append(EarlyStopping(early.metric, mode=early.get("mode", "min"),
                                 patience=early.get("patience", 3),
                                 min_delta=early.get("min_delta", 0.0), every_steps=eval_every))
  if checkpointer:
    actions.append(Checkpoint(checkpointer, eval_every_steps=eval_every))
  profile = config.get("profile")
  if profile is not None and profile.get("num_steps"):
    logdir = profile.get("logdir") or workdir
    if not logdir:
      raise ValueError(f"config.profile.num_steps={profile.num_steps} but there is no "
                       f"directory for the trace: set config.profile.logdir, or pass "
                       f"fit(workdir=...).")
    actions.append(Profile(logdir, first_step=profile.get("first_step", 0),
                           num_steps=profile.num_steps))
  return actions


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


__all__ = ["Action", "Checkpoint", "EarlyStopping", "Evaluate", "FiniteGuard", "FitResult",
           "Loop", "NonFiniteError", "PeriodicCallback", "Profile", "ReportMetrics",
           "StopOnSignal", "default_actions"]
