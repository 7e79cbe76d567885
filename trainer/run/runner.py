"""A run: what `Trainer.fit` does, built once from the Trainer's parts.

`Runner.fit` is the whole story of a run, top to bottom:

1. where it starts: the latest checkpoint (resume), a given state, or a new
   one (`trainer.run.start`);
2. what a step costs: the step's FLOPs (counted when first logged) and tokens,
   for throughput and MFU (`trainer.throughput`);
3. eval and predict traced before the first step, so a mistake in them stops
   the run before it trains;
4. the compiled calls: one step a call, or `config.steps_per_call` (a chunk
   plan, `trainer.loop.chunks`), fed with host batches or a device dataset
   (`trainer.run.calls`);
5. the loop (`trainer.loop.driver.run`) with the actions, under the watchdog,
   waiting for the last checkpoint save on the way out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax

from strategies import Strategy
from strategies.capabilities import models_named
from strategies.summary import summarize
from strategies.tree import to_host
from trainer import throughput
from trainer.checkpoint import Checkpointer, CheckpointError
from trainer.data.feed import check_train_batch
from trainer.evaluation import Evaluator
from trainer.loop import driver
from trainer.loop.actions import Action, FitResult
from trainer.loop.builtin import ReportMetrics
from trainer.loop.chunks import ChunkPlan
from trainer.loop.timing import LoopClock, Watchdog
from trainer.run import lock
from trainer.run.calls import compiles_at, device_data_calls, host_batch_calls
from trainer.run.options import RunOptions
from trainer.run.start import Start, TrainData, start
from trainer.run.state import States
from trainer.step.functions import CompiledSteps

if TYPE_CHECKING:  # Only annotations: clu's writers import TensorFlow (seconds).
  from clu import metric_writers

Batch = Mapping[str, Any]
PyTree = Any


@dataclasses.dataclass(frozen=True)
class Runner:
  """Drives the compiled steps through runs; built by the Trainer from its parts.

  Attributes:
    options: how calls are fed and made, and the watchdog's limits (`RunOptions`).
    strategy: places batches, compiles, brings results to the host.
    compiled: the compiled train steps.
    evaluator: eval and predict (traced before the first step).
    states: makes or restores the run's state.
    batch_size: examples per step (`config.batch_size`), over all processes.
    skips_nonfinite: the recipe leaves non-finite updates out (else a run stops at one).
    tokens_per_example: the Trainer's hook, `batch -> tokens in one example, or None`.
  """

  options: RunOptions
  strategy: Strategy
  compiled: CompiledSteps
  evaluator: Evaluator
  states: States
  batch_size: int
  skips_nonfinite: bool
  tokens_per_example: Callable[[Batch], int | None]

  def fit(self, train_batches: TrainData, *, num_steps: int, actions: Sequence[Action],
          state: PyTree | None = None,
          eval_batches: Callable[[], Iterable[Batch]] | None = None,
          writer: metric_writers.MetricWriter | None = None,
          checkpointer: Checkpointer | None = None, workdir: str | None = None) -> FitResult:
    """Trains until `state.step == num_steps` (or an action stops it), running `actions`
    (every action of the run, in order) after each call. The other arguments are
    `Trainer.fit`'s, which says what each may be and what is raised. The run holds the
    lock of `workdir` (else of the checkpoint directory) throughout (`trainer.run.lock`)."""
    lock_dir = workdir or (checkpointer.directory if checkpointer else None)
    with lock.held(lock_dir):
      return self._fit(train_batches, num_steps=num_steps, actions=actions, state=state,
                       eval_batches=eval_batches, writer=writer, checkpointer=checkpointer)

  def _fit(self, train_batches: TrainData, *, num_steps: int, actions: Sequence[Action],
           state: PyTree | None, eval_batches: Callable[[], Iterable[Batch]] | None,
           writer: metric_writers.MetricWriter | None,
           checkpointer: Checkpointer | None) -> FitResult:
    begin = start(train_batches, state=state, checkpointer=checkpointer, actions=actions,
                  states=self.states, strategy=self.strategy, batch_size=self.batch_size,
                  check_batch=self.check_batch)
    flops, tokens = self._throughput(begin)
    if logging.getLogger().isEnabledFor(logging.INFO):  # The summary reads every shard.
      logging.info("Strategy %s\n  %s", summarize(self.strategy, begin.state), flops.describe())
    # Eval and predict are traced now, so that a mistake in them stops the run
    # before it trains rather than at the first evaluation.
    self.evaluator.trace(begin.state, begin.batch, eval_batches)
    clock = next((a.clock for a in actions if isinstance(a, ReportMetrics)), LoopClock())
    plan = (ChunkPlan(self.options.steps_per_call, start=begin.step, num_steps=num_steps,
                      actions=actions)
            if self.options.steps_per_call > 1 or begin.device_data is not None else None)
    advance = self._calls(begin, num_steps, plan, clock)
    steps_axis = self.strategy.steps_axis if plan else None
    finite = driver.FiniteCheck(skip=self.skips_nonfinite, to_host=to_host,
                                which_models=models_named(self.strategy),
                                saved_note=lambda: last_finite_checkpoint(checkpointer),
                                steps_axis=steps_axis,
                                # A host function's error (a reward's) ends the run there.
                                host_error=self.compiled.host_calls.raise_if_failed)
    with waiting_for_saves(checkpointer), watching(self.options, clock, checkpointer):
      result = driver.run(advance, state=begin.state, start=begin.step, num_steps=num_steps,
                          actions=actions, finite=finite, canonical=self.strategy.to_canonical,
                          steps_axis=steps_axis, clock=clock, flops=flops,
                          tokens_per_step=tokens)
    if writer is not None:
      writer.flush()
    return result

  def check_batch(self, batch: Batch, step: int) -> None:
    """Raises unless `batch` holds this process's rows of a `batch_size` batch for `step`."""
    for one in self.strategy.model_batches(batch):  # Each member's, where each reads its own.
      check_train_batch(one, step, batch_size=self.batch_size,
                        rows=self.strategy.process_slice(self.batch_size))

  def _throughput(self, begin: Start) -> tuple[throughput.StepFlops, int | None]:
    """The train step's FLOPs (counted from its jaxpr when first asked for) and the tokens
    in one global batch (None: not a token model)."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), begin.state)
    flops = throughput.StepFlops(
        self.compiled.train(begin.state),
        lambda: (abstract, self.strategy.put_batch(begin.batch)),
        num_devices=self.strategy.num_devices)
    tokens = self.tokens_per_example(self.strategy.model_batches(begin.batch)[0])
    models = max(1, self.strategy.batch_models)  # Each member its own rows: all counted.
    return flops, tokens * self.batch_size * models if tokens else None

  def _calls(self, begin: Start, num_steps: int, plan: ChunkPlan | None,
             clock: LoopClock) -> driver.Advance:
    """The run's `advance`: over the device dataset, or over host batches from the first."""
    if begin.device_data is not None:
      advance = device_data_calls(self.compiled, self.strategy, begin.state,
                                  begin.device_data, plan=plan)
    else:
      advance = host_batch_calls(
          self.compiled, self.strategy, begin.state, itertools.chain([begin.batch], begin.batches),
          start=begin.step, num_steps=num_steps, plan=plan, prefetch=self.options.prefetch,
          source=begin.batches, check=self.check_batch, clock=clock)
    advance.compiles_at = compiles_at(plan)
    return advance


@contextlib.contextmanager
def watching(options: RunOptions, clock: LoopClock, checkpointer: Checkpointer | None):
  """A `Watchdog` on the loop while it runs, if `options.watchdog_seconds` is set."""
  if not options.watchdog_seconds:
    yield
    return
  watchdog = Watchdog(options.watchdog_seconds, options.watchdog_slow_seconds,
                      cleanup=checkpointer.remove_partial if checkpointer else lambda: None)
  clock.watchdog = watchdog
  watchdog.start()
  try:
    yield
  finally:
    watchdog.stop()
    clock.watchdog = None


def last_finite_checkpoint(checkpointer: Checkpointer | None) -> str:
  """Which checkpoint holds the last finite state, once the last save is on disk."""
  if not checkpointer:
    return "no checkpoint was written"
  checkpointer.wait()
  latest = checkpointer.latest_step()
  if latest is None:
    return "no checkpoint was written"
  return f"the latest checkpoint is step {latest} in {checkpointer.directory}"


@contextlib.contextmanager
def waiting_for_saves(checkpointer: Checkpointer | None):
  """Waits for the last save on the way out, without hiding an error in flight."""
  try:
    yield
  except BaseException:
    if checkpointer:
      try:
        checkpointer.wait()
      except CheckpointError:
        logging.exception("The last checkpoint save failed as well")
    raise
  if checkpointer:
    checkpointer.wait()
