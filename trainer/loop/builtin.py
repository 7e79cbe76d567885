"""The built-in actions, in the order `from_config` (and so `Trainer.default_actions`)
gives them:

1. `RecordConfig` writes the config the run ran with to `<workdir>/config.json` and
   the writer's hyperparameters (TensorBoard's hparams), before the first call.
2. `StopOnSignal` turns SIGTERM and the first Ctrl-C into a stop request at a step
   boundary.
3. `ReportMetrics` writes train scalars every `log_every_steps` (and `ReportSpikes`
   the updates left out as loss spikes, with `config.spikes.skip`).
4. `Evaluate` evaluates (each `Recipe.eval_variants`: the EMA parameters as `ema_*`);
   a sweep's report (`trainer.sweep.SweepReport`) comes right after it.
5. `EarlyStopping` reads that evaluation and may request a stop.
6. `Checkpoint` saves the run periodically, at each evaluation when it keeps
   the best checkpoints by a metric, and at the end (so a stopped run is saved).
7. `Profile` traces a window of steps with `jax.profiler`.
8. `RecordStatus` writes `<workdir>/status.json`: running, finished, stopped or failed
   (`trainer.loop.status`).

Each gets the parts it needs when it is built (a writer, the evaluator, the
save function), never the Trainer.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import ml_collections

from strategies import Strategy
from trainer import throughput as throughput_lib
from trainer.checkpoint import Checkpointer, save_run
from trainer.loop.actions import Action, Produced, StepView, next_multiple
from trainer.loop.reporting import ReportMetrics, ReportSpikes
from trainer.loop.status import RecordStatus
from trainer.step.recipe import Recipe

if TYPE_CHECKING:  # Only annotations: clu's writers import TensorFlow (seconds).
  from clu import metric_writers

Batch = Mapping[str, Any]
PyTree = Any


class RecordConfig(Action):
  """Before the first call, on process 0: the run's config, every override applied, to
  `<workdir>/config.json` (`trainer.run.workdir.write_config`, what `trainer.generate`,
  `trainer.harness` and `trainer.export` read) and to `writer.write_hparams` (TensorBoard's
  hparams; the console only says where they are)."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str,
               writer: metric_writers.MetricWriter):
    super().__init__(every_steps=0)
    self.config, self.workdir, self.writer = config, workdir, writer

  def begin(self, view: StepView) -> None:
    if jax.process_index() != 0:
      return
    from trainer.run.workdir import write_config
    path = write_config(self.workdir, self.config)
    self.writer.write_hparams(self.config.to_dict())
    logging.info("The run's config: %s", path)


class StopOnSignal(Action):
  """Requests a stop at the first step boundary after one of `signals` arrives: SIGTERM (a
  scheduler's preemption) and the first SIGINT (Ctrl-C), after which the run saves a
  checkpoint and `fit` returns (`stopped_by` names the signal). A second SIGINT stops at
  once: the step in flight is not finished, nothing more is saved, and the process exits
  with status 130 and one line (no traceback); the latest complete checkpoint is as it was.

  On one process a Python handler notes the signal. On a multi-process run
  (`jax.distributed`) a SIGTERM reaches one process, or several at different
  steps, so the processes must agree on where to stop: jax's preemption
  service (which catches SIGTERM itself) tells every process the same step,
  the first one all of them can still reach, and each stops there, so they
  save one checkpoint together (`trainer.distributed.launch` turns a Ctrl-C into a
  SIGTERM to every process). Outside the main thread (where Python cannot install
  handlers) a one-process run ignores signals.
  """

  def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)):
    super().__init__(every_steps=1)
    self.signals = tuple(signals)
    self.received: int | None = None
    self._previous: dict[int, Any] = {}

  def _handle(self, signum, frame):
    del frame
    if signum == signal.SIGINT and self.received is not None:
      stop_at_once()
    # Noted before anything else runs: a second Ctrl-C can interrupt this very handler (Python
    # runs a pending handler at the next bytecode), and must find the first one noted.
    self.received = signum
    if signum == signal.SIGINT:
      logging.warning("Ctrl-C: the run stops after this step and saves a checkpoint; press "
                      "Ctrl-C again to stop at once, without saving.")

  def begin(self, view: StepView) -> None:
    if jax.process_count() > 1:
      return  # The distributed runtime's handler must keep SIGTERM.
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in self.signals}

  def triggers(self, view: StepView) -> bool:
    return True

  def next_boundary(self, step: int) -> None:
    return None  # Stops at the end of the call running when the signal comes.

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


def stop_at_once() -> None:
  """A second Ctrl-C: raises `KeyboardInterrupt` here, and the process, if nothing catches
  it, prints one line and exits with status 130 instead of a traceback."""
  import sys

  previous = sys.excepthook

  def one_line(kind, value, traceback):
    if not issubclass(kind, KeyboardInterrupt):
      return previous(kind, value, traceback)
    sys.stderr.write("Stopped at once by a second Ctrl-C; the latest complete checkpoint is "
                     "as it was: run the same command to resume from it.\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)  # The error has come through every `finally`: nothing is left to do.

  sys.excepthook = one_line
  raise KeyboardInterrupt


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

  time_category = "eval"

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

  time_category = "checkpoint"

  reads_state = True

  def __init__(self, save: Callable[[Any], None], *, wait: Callable[[], None],
               step_dir: Callable[[int], str], every_steps: int, eval_every_steps: int = 0):
    super().__init__(every_steps=every_steps)
    self.save, self.wait, self.step_dir = save, wait, step_dir
    self.eval_every_steps = eval_every_steps
    self._last: int | None = None

  def triggers(self, view: StepView) -> bool:
    return super().triggers(view) or bool(view.crossed(self.eval_every_steps))

  def next_boundary(self, step: int) -> int | None:
    ends = [next_multiple(step, every) for every in (self.every_steps, self.eval_every_steps)]
    return min((b for b in ends if b is not None), default=None)

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

  def next_boundary(self, step: int) -> int | None:
    return next((b for b in (self.first_step, self.first_step + self.num_steps) if b > step),
                None)

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
  """`user` inserted before the first `Checkpoint` of `defaults` (else before
  `RecordStatus`, else at the end).

  Then a checkpoint of step s holds the user actions' state after step s.

  Raises:
    ValueError: two actions that save state share a name (their states would collide).
  """
  at = next((i for i, a in enumerate(defaults) if isinstance(a, Checkpoint | RecordStatus)),
            len(defaults))
  actions = [*defaults[:at], *user, *defaults[at:]]
  names = [a.name for a in actions if a.state_dict() is not None]
  dup = {n for n in names if names.count(n) > 1}
  if dup:
    raise ValueError(f"actions {sorted(dup)} appear twice and both save state; give one a "
                     f"different `name`.")
  return actions


def from_config(config: ml_collections.ConfigDict, *, writer: metric_writers.MetricWriter,
                strategy: Strategy, recipe: Recipe,
                evaluate: Callable[[Any, Iterable[Batch]], dict[str, float]],
                learning_rate: Callable[[int], float | None],
                checkpointer: Checkpointer | None,
                eval_batches: Callable[[], Iterable[Batch]] | None, workdir: str | None,
                after_eval: Sequence[Action] = ()) -> list[Action]:
  """The built-in actions the config asks for, in this module's order.

  Args:
    config: `log_every_steps`, `eval_every_steps`, `batch_size`,
      `early_stopping.*`, `profile.*`, `mixed_precision.compute_dtype` (for MFU).
    writer: where scalars go.
    strategy: brings metrics to the host, and saves the run in its layout.
    recipe: whether non-finite updates are skipped (and counted); the eval variants.
    evaluate: `(state, batches) -> results`.
    learning_rate: `step -> rate`, logged.
    checkpointer: where the run is saved (None: no checkpoints, no SIGTERM handling).
    eval_batches: returns a fresh iterable of eval batches (None: no evaluation).
    workdir: where the run's config goes (`RecordConfig`; None: nowhere), and a profile
      trace when `profile.logdir` is empty.
    after_eval: actions that run right after `Evaluate` (a sweep's report), or where it
      would run.

  Raises:
    ValueError: an early-stopping or profile setting that cannot work (before any step).
  """
  actions: list[Action] = [RecordConfig(config, workdir, writer)] if workdir else []
  if checkpointer:
    actions.append(StopOnSignal())
  actions.append(ReportMetrics(
      writer, every_steps=config.log_every_steps, fetch_metrics=strategy.fetch_metrics,
      merge_host_metrics=strategy.merge_host_metrics, learning_rate=learning_rate,
      batch_size=config.batch_size, counts_skipped=recipe.skips_nonfinite,
      peak_tflops=lambda: throughput_lib.peak_tflops(jax.devices()[0],
                                                     config.mixed_precision.compute_dtype),
      flops_figures=throughput_lib.reports_flops(jax.devices()[0])))
  if recipe.skips_spikes:
    actions.append(ReportSpikes(writer, every_steps=config.log_every_steps,
                                to_host=strategy.to_canonical))
  if eval_batches is not None:
    actions.append(Evaluate(writer, evaluate, eval_batches, every_steps=config.eval_every_steps,
                            variants=recipe.eval_variants))
  actions.extend(after_eval)
  actions.extend(_early_stopping(config, has_eval=eval_batches is not None))
  if checkpointer:
    actions.append(Checkpoint(
        lambda run: save_run(checkpointer, strategy, run), wait=checkpointer.wait,
        step_dir=checkpointer.step_dir, every_steps=checkpointer.every_steps,
        eval_every_steps=config.eval_every_steps if checkpointer.best_metric else 0))
  actions.extend(_profile(config, workdir))
  if workdir:  # Last: `finished` once the final checkpoint is saved.
    actions.append(RecordStatus(workdir))
  return actions


def _early_stopping(config: ml_collections.ConfigDict, *, has_eval: bool) -> list[Action]:
  es = config.early_stopping
  if not es.metric:
    return []
  if not has_eval:
    raise ValueError(f"config.early_stopping.metric={es.metric!r} needs eval batches; "
                     f"fit() got eval_batches=None.")
  return [EarlyStopping(es.metric, mode=es.mode, patience=es.patience, min_delta=es.min_delta,
                        every_steps=config.eval_every_steps)]


def _profile(config: ml_collections.ConfigDict, workdir: str | None) -> list[Action]:
  profile = config.profile
  if not profile.num_steps:
    return []
  logdir = profile.logdir or workdir
  if not logdir:
    raise ValueError(f"config.profile.num_steps={profile.num_steps} but there is no "
                     f"directory for the trace: set config.profile.logdir, or pass "
                     f"fit(workdir=...).")
  return [Profile(logdir, first_step=profile.first_step, num_steps=profile.num_steps)]


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises unless the `early_stopping` and `profile` settings can work: the actions'
  constructors check them, so this builds them once, unused.

  Raises:
    ValueError: naming the field, its value and what is accepted.
  """
  es = config.early_stopping
  if es.metric:
    EarlyStopping(es.metric, mode=es.mode, patience=es.patience, min_delta=es.min_delta,
                  every_steps=config.eval_every_steps)
  if config.profile.num_steps:
    Profile("", first_step=config.profile.first_step, num_steps=config.profile.num_steps)


def __getattr__(name: str):
  if name == "SweepReport":  # Moved to the sweep's package; this path keeps working.
    from trainer.sweep.report import SweepReport
    return SweepReport
  raise AttributeError(f"module 'trainer.loop.builtin' has no attribute {name!r}")


__all__ = ["Checkpoint", "EarlyStopping", "Evaluate", "Profile", "RecordConfig", "RecordStatus",
           "ReportMetrics", "ReportSpikes", "StopOnSignal", "check_config", "from_config",
           "with_user_actions"]
