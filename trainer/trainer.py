"""The Trainer: the hooks a research project overrides, and the parts it composes from them.

A research project subclasses `Trainer`, supplies a Flax module
(`build_model`) and a per-example loss (`loss`), and may override how the
model is called, the metrics, the optimizer, the recipe and the actions. The
constructor builds every part once, from the hooks and the config, checking
the config before any compute:

- `strategy` (`strategies`): device layout, compilation, collectives;
- `recipe` (`trainer.step.recipe`): the step transforms (precision,
  accumulation, EMA, non-finite skipping, and any the user adds);
- `steps` (`trainer.step.functions`): the pure init/train/eval/predict
  functions built from the hooks and the recipe, and `compiled`, their
  compiled forms;
- `evaluator` (`trainer.evaluation`): eval and predict over batches of any size.

`fit` resumes what a checkpoint holds, places the data (host batches fed
ahead of their call, or a dataset that lives on the devices), and hands the
rest to the loop (`trainer.loop.driver`), one compiled call of
`config.steps_per_call` steps at a time (`trainer.loop.chunks`). The Trainer
never touches devices itself.
"""

from __future__ import annotations

import abc
import contextlib
import itertools
import json
import logging
import os
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import optax
from clu import metric_writers
from clu import metrics as clu_metrics

from strategies import Strategy, check_processes, create_strategy
from strategies.capabilities import models_named
from strategies.summary import summarize
from strategies.tree import to_host
from trainer import metrics as metrics_lib
from trainer import throughput
from trainer.checkpoint import (
  Checkpointer,
  CheckpointError,
  RunState,
  init_from,
  restore_run,
  save_run,
)
from trainer.data.device import DeviceData, DeviceSource
from trainer.data.feed import DeviceFeed, check_train_batch, is_checkpointable
from trainer.evaluation import MASK_KEY, Evaluator
from trainer.loop import builtin as actions_lib
from trainer.loop import driver
from trainer.loop.actions import Action, FitResult
from trainer.loop.chunks import ChunkPlan
from trainer.loop.timing import LoopClock, Watchdog
from trainer.step import model_variables
from trainer.step.functions import (
  STEP_LOOPS,
  CompiledSteps,
  StepFunctions,
  default_steps_loop,
)
from trainer.step.optim import (
  check_run_length,
  create_optimizer,
  create_schedule,
  grouped_optimizer,
  parameter_labels,
)
from trainer.step.recipe import Recipe, recipe_from_config
from trainer.step.remat import Remat
from trainer.step.train_state import TrainState
from trainer.sweep import (
  Sweep,
  check_sweep_fits,
  format_table,
  place_hyperparameters,
  single_model_opt_state,
  summary_rows,
  swept_optimizer,
)
from trainer.sweep import plot as sweep_plot

Batch = Mapping[str, Any]
PyTree = Any


class Trainer(abc.ABC):
  """Trains one Flax module under the strategy named in `config.strategy.name`.

  Required hooks: `build_model` (a Linen module, or a factory of an NNX one)
  and `loss`. Optional hooks: `model_inputs` (what the model is called with),
  `apply_model`, `train_metrics`, `eval_metrics`, `prediction`,
  `build_schedule`, `build_optimizer`, `build_recipe` (the step transforms),
  `create_train_state`, `default_actions` (the loop's side effects), and
  `train_step` / `eval_step` / `predict_step` themselves.

  Model variables: `state.params` and `state.model_state` (every other
  collection, e.g. BatchNorm's `batch_stats`: updated by the train step, read
  by eval and predict, checkpointed). `trainer.step.model_variables` is the
  one place that knows Linen from NNX.

  Modes and randomness: the train step calls the model in training mode, eval
  and predict in eval mode. Each stream in `rng_streams` gets its own key,
  derived from `fold_in(state.rng, step)`; strategies whose step sees a batch
  shard fold in the replica index (`Strategy.replica_rng`); ensemble members
  draw from their own `state.rng`.

  Attributes:
    input_key: the batch entry passed to the model by the default `model_inputs`.
    target_key: the batch entry holding targets, for losses and metrics.
    rng_streams: the named RNG streams the model draws from (Linen
      `make_rng(name)`, NNX `rngs.name`); add any stream your model asks for.
  """

  input_key: str = "inputs"
  target_key: str = "targets"
  rng_streams: tuple[str, ...] = ("dropout",)

  def __init__(self, config: ml_collections.ConfigDict, *, strategy: Strategy | None = None,
               num_train_steps: int | None = None):
    """Builds the parts, validating the config before any compute.

    Args:
      config: the run's config.
      strategy: overrides the one `config.strategy` names.
      num_train_steps: the run's length, which decaying learning-rate schedules
        need; defaults to `config.num_train_steps` when that is positive.

    Raises:
      ValueError: an unknown strategy or optimizer, a mesh or rule table that
        does not fit the devices, a batch size that does not split evenly (into
        data replicas and `grad_accum_steps` microbatches), or a recipe field
        out of range, or `steps_per_call` below 1.
    """
    self.config = config
    self.sweep = Sweep.from_config(config)  # Checked before the strategy counts its members.
    if strategy is None:
      try:
        strategy = create_strategy(config)  # Checks the process count itself.
      except ValueError as e:
        if self.sweep is None or config.ensemble_size:
          raise
        raise ValueError(f"config.sweep describes {len(self.sweep)} members (the ensemble's "
                         f"size, since config.ensemble_size=0): {e}") from e
    else:
      check_processes(type(strategy))
    self.strategy = strategy
    self.strategy.check_batch_size(config.batch_size)
    if self.sweep is not None:
      check_sweep_fits(self.sweep, strategy)
      if strategy.member_seeds is None:  # A strategy built in code: the sweep's seeds.
        strategy.member_seeds = [int(m["seed"]) for m in self.sweep.members]
    if num_train_steps is None and config.num_train_steps > 0:
      num_train_steps = config.num_train_steps
    self.num_train_steps = num_train_steps
    self.prefetch = config.prefetch_to_device
    if not isinstance(self.prefetch, int) or self.prefetch < 0:
      raise ValueError(f"config.prefetch_to_device={self.prefetch!r} must be an integer >= 0: "
                       f"how many train batches are put on the devices ahead of their step.")
    self.steps_per_call = config.steps_per_call
    if not isinstance(self.steps_per_call, int) or self.steps_per_call < 1:
      raise ValueError(f"config.steps_per_call={self.steps_per_call!r} must be an integer "
                       f">= 1: how many train steps one compiled call runs.")
    for field, zero in (("watchdog_seconds", "no watchdog"),
                        ("watchdog_slow_seconds", "10x watchdog_seconds")):
      value = config[field]
      if not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"config.{field}={value!r} must be a number of seconds >= 0 "
                         f"(0: {zero}).")
    self.step_flops: throughput.StepFlops | None = None  # Set by `fit`, with:
    self.tokens_per_step: int | None = None
    steps_loop = config.steps_loop or default_steps_loop(jax.devices()[0].platform)
    if steps_loop not in STEP_LOOPS:
      raise ValueError(f"config.steps_loop={config.steps_loop!r} is not one of {STEP_LOOPS} "
                       f"(or '' for the platform's default).")
    self.recipe = self.build_recipe()
    self.compiled = CompiledSteps(self, self.strategy, steps_loop=steps_loop)
    self.evaluator = Evaluator(self.strategy, self.compiled, config.eval_batch_size)
    self.schedule = self.build_schedule()
    self.model = self.build_model()
    self.model_variables = model_variables.create(self.model,
                                                  sync_batchnorm=config.sync_batchnorm,
                                                  remat=Remat.from_config(config))
    self.optimizer = self.build_optimizer()
    self.steps = StepFunctions(self, self.strategy,
                               lambda rngs, inputs: self.model_variables.init(rngs, inputs),
                               self.recipe)
    self.init_source = (init_from.open_source(config.init_from.path, step=config.init_from.step,
                                              linen=self._linen)
                        if config.init_from.path else None)

  # -- Hooks a research project overrides ------------------------------------

  @abc.abstractmethod
  def build_model(self) -> nn.Module | Callable[..., Any]:
    """The Flax module to train: a Linen `nn.Module`, or an NNX module's factory.

    For NNX return the class (or a `functools.partial` of it) that takes
    `rngs=`; the Trainer builds it inside the traced init, once per seed or
    ensemble member.
    """

  @abc.abstractmethod
  def loss(self, outputs: Any, batch: Batch) -> jax.Array:
    """Per-example losses, shape [batch], for the model's outputs on `batch`."""

  def build_recipe(self) -> Recipe:
    """The step transforms, in order: the config's (`recipe_from_config`) by default.

    Override to add one the config cannot express (SAM, dynamic loss scaling):
    `return super().build_recipe() + [MyTransform()]`.
    """
    return recipe_from_config(self.config, num_data_replicas=self.strategy.num_data_replicas,
                              strategy_name=self.strategy.name)

  def build_schedule(self) -> optax.Schedule | None:
    """`step -> learning rate`, logged as `train/learning_rate`; from `config.schedule`.

    Return None if `build_optimizer` makes its own learning rates (a sweep's are per
    member, in each member's optimizer state).
    """
    if self.sweep is not None:
      return None
    return create_schedule(self.config, self.num_train_steps)

  def build_optimizer(self) -> optax.GradientTransformation:
    """The optax optimizer; by default `trainer.step.optim.create_optimizer` with `self.schedule`.

    The default clips by `grad_clip_norm` and decays the weights that
    `trainer.step.optim.default_decay_mask` selects (not biases or norm scales).
    Under `config.sweep` the same chain takes each member's hyperparameters from
    its state (`trainer.sweep.swept_optimizer`). Parameters are grouped (frozen,
    `config.param_groups`) when the config has patterns or `parameter_labels` is
    overridden.
    """
    labels = self.parameter_labels if self._groups_parameters else None
    if self.sweep is not None:
      return swept_optimizer(self.config, self.sweep, self.num_train_steps, labels=labels)
    if labels is not None:
      return grouped_optimizer(self.config, self.schedule, labels=labels)
    return create_optimizer(self.config, self.schedule)

  @property
  def _groups_parameters(self) -> bool:
    """Whether parameters are grouped: config patterns, or an overridden `parameter_labels`."""
    return bool(self.config.freeze or self.config.param_groups
                or type(self).parameter_labels is not Trainer.parameter_labels)

  def parameter_labels(self, params: PyTree) -> PyTree:
    """Each parameter's group: `'frozen'`, `'group<i>'` (`config.param_groups[i]`) or
    `'default'`; by default from the config's path patterns. Override to choose in code
    (e.g. by shape); it is called with the parameters while the state is built."""
    return parameter_labels(params, freeze=tuple(self.config.freeze),
                            groups=[dict(g) for g in self.config.param_groups])

  def tokens_per_example(self, batch: Batch) -> int | None:
    """Tokens in one example of `batch`, for `train/tokens_per_sec`; None: not a token
    model (`LanguageModelTrainer` counts its targets)."""
    del batch
    return None

  def learning_rate(self, step: int) -> float | None:
    """The learning rate of the update from `step` to `step + 1`, or None if unknown."""
    return None if self.schedule is None else float(self.schedule(step))

  def model_inputs(self, batch: Batch, *, train: bool,
                   rngs: Mapping[str, jax.Array]) -> tuple[tuple, dict]:
    """`(args, kwargs)` the model is called with on `batch`: `(batch[input_key],), {}`.

    Override for several inputs (`(batch['inputs'], batch['targets']), {}`) or
    an RNG argument (`rngs['z']`, with 'z' in `rng_streams`). The mode
    arguments the module declares (`train`, `deterministic`) are added unless
    given here, and an NNX module whose `__call__` takes `rngs` gets them.
    """
    del train, rngs
    return (batch[self.input_key],), {}

  def apply_model(self, params: PyTree, model_state: PyTree, batch: Batch, *,
                  rngs: Mapping[str, jax.Array], train: bool) -> tuple[Any, PyTree]:
    """`(outputs, new model_state)` of the model on one (per-replica) batch.

    The call runs with `strategies.BATCH_AXIS` bound to the step's data axis.
    """
    inputs = self.model_inputs(batch, train=train, rngs=rngs)
    return self.strategy.bind_batch_axis(
        lambda inputs: self.model_variables.apply(
            params, model_state, inputs, rngs=rngs, train=train,
            require_batch_axis=self.strategy.step_sees_batch_shard), inputs)

  def step_rngs(self, key: jax.Array) -> model_variables.RngStreams:
    """One key per stream of `rng_streams`, each a function of `key` and the stream name.

    Reading a stream that is not in `rng_streams` raises an error naming it.
    """
    return model_variables.RngStreams(
        {name: jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
         for name in self.rng_streams})

  def train_metrics(self, outputs: Any, batch: Batch, loss: jax.Array) -> clu_metrics.Collection:
    """Metrics of one training step, from the per-example losses."""
    del outputs, batch
    return metrics_lib.LossMetrics.single_from_model_output(loss=loss)

  def eval_metrics(self, outputs: Any, batch: Batch) -> clu_metrics.Collection:
    """Metrics of one eval batch; `batch['mask']` marks the real (unpadded) examples."""
    return metrics_lib.LossMetrics.single_from_model_output(
        loss=self.steps.per_example_loss(outputs, batch), mask=batch[MASK_KEY])

  def prediction(self, outputs: Any) -> jax.Array:
    """What an ensemble averages over members: class probabilities by default."""
    return jax.nn.softmax(outputs, axis=-1)

  def create_train_state(self, *, params: PyTree, model_state: PyTree,
                         rng: jax.Array) -> TrainState:
    """The initial state of one model; the recipe adds what it keeps (EMA parameters)."""
    return TrainState.create(apply_fn=self.model_variables.apply, params=params,
                             model_state=model_state, tx=self.optimizer, rng=rng)

  def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, PyTree]:
    """One optimizer update (`trainer.step.functions.StepFunctions.train`)."""
    return self.steps.train(state, batch)

  def eval_step(self, state: TrainState, batch: Batch) -> PyTree:
    """Metrics of one padded eval batch."""
    return self.steps.eval(state, batch)

  def predict_step(self, state: TrainState, batch: Batch) -> jax.Array:
    """Predictions, averaged over ensemble members where there are several."""
    return self.steps.predict(state, batch)

  def default_actions(self, *, checkpointer: Checkpointer | None,
                      eval_batches: Callable[[], Iterable[Batch]] | None,
                      workdir: str | None,
                      writer: metric_writers.MetricWriter | None = None) -> list[Action]:
    """The loop's built-in actions the config asks for (`trainer.loop.builtin`).

    Override to reorder or replace them; `fit(actions=...)` adds to them.

    Raises:
      ValueError: an early-stopping or profile setting that cannot work (before any step).
    """
    config, writer = self.config, writer or metric_writers.LoggingWriter()
    eval_every = config.eval_every_steps
    actions: list[Action] = [actions_lib.StopOnSignal()] if checkpointer else []
    actions.append(actions_lib.ReportMetrics(
        writer, every_steps=config.log_every_steps,
        fetch_metrics=self.strategy.fetch_metrics,
        merge_host_metrics=self.strategy.merge_host_metrics, learning_rate=self.learning_rate,
        batch_size=config.batch_size, counts_skipped=self.recipe.skips_nonfinite,
        flops=lambda: self.step_flops,
        peak_tflops=lambda: throughput.peak_tflops(jax.devices()[0],
                                                   config.mixed_precision.compute_dtype),
        tokens_per_step=lambda: self.tokens_per_step))
    if eval_batches is not None:
      actions.append(actions_lib.Evaluate(writer, self.evaluate, eval_batches,
                                          every_steps=eval_every,
                                          variants=self.recipe.eval_variants))
    if self.sweep is not None and eval_batches is not None:
      actions.append(actions_lib.SweepReport(
          writer, self.evaluator.evaluate_members, eval_batches,
          labels=[self.sweep.label(i) for i in range(len(self.sweep))],
          every_steps=eval_every, metric=config.sweep.metric, mode=config.sweep.mode,
          summarize=lambda state, step, results, best: self.finish_sweep(
              state, step, results, best, workdir)))
    if config.early_stopping.metric:
      if eval_batches is None:
        raise ValueError(f"config.early_stopping.metric={config.early_stopping.metric!r} "
                         f"needs eval batches; fit() got eval_batches=None.")
      actions.append(actions_lib.EarlyStopping(
          config.early_stopping.metric, mode=config.early_stopping.mode,
          patience=config.early_stopping.patience, min_delta=config.early_stopping.min_delta,
          every_steps=eval_every))
    if checkpointer:
      actions.append(actions_lib.Checkpoint(
          lambda run: save_run(checkpointer, self.strategy, run), wait=checkpointer.wait,
          step_dir=checkpointer.step_dir, every_steps=checkpointer.every_steps,
          eval_every_steps=eval_every if checkpointer.best_metric else 0))
    if config.profile.num_steps:
      logdir = config.profile.logdir or workdir
      if not logdir:
        raise ValueError(f"config.profile.num_steps={config.profile.num_steps} but there is "
                         f"no directory for the trace: set config.profile.logdir, or pass "
                         f"fit(workdir=...).")
      actions.append(actions_lib.Profile(logdir, first_step=config.profile.first_step,
                                         num_steps=config.profile.num_steps))
    return actions

  # -- Running -----------------------------------------------------------------

  def init_state(self, example_batch: Batch, rng: jax.Array | None = None) -> TrainState:
    """Creates the placed train state; `rng` defaults to `PRNGKey(config.seed)`."""
    if rng is None:
      rng = jax.random.PRNGKey(self.config.seed)
    init_fn = self.steps.init_fn(example_batch)
    if self.init_source is not None:  # The rules are checked before anything is computed.
      abstract = jax.eval_shape(init_fn, rng)
      plan = init_from.plan(
          self.config, self.init_source,
          init_from.variables_by_collection(abstract.params, abstract.model_state,
                                            linen=self._linen),
          num_members=self.strategy.checkpoint_layout()["num_members"])
    state = self.strategy.create_state(init_fn, rng)
    if self.init_source is not None:
      state = init_from.start_from(plan, self.strategy, state, abstract, self._fresh_state,
                                   linen=self._linen)
    if self.sweep is not None:  # Each member's own hyperparameters into its optimizer.
      state = place_hyperparameters(state, self.sweep)
    return state

  @property
  def _linen(self) -> bool:
    return isinstance(self.model_variables, model_variables.LinenVariables)

  def _fresh_state(self, state: TrainState) -> TrainState:
    """A new state of one model from `state`'s variables and RNG (optimizer, recipe: fresh)."""
    return self.recipe.init_state(self.create_train_state(
        params=state.params, model_state=state.model_state, rng=state.rng))

  def compiled_train_step(self, state: TrainState) -> Callable:
    """The compiled `(state, placed batch) -> (state, outputs)` that `fit` calls each step."""
    return self.compiled.train(state)

  def compiled_train_step_text(self, state: TrainState, example_batch: Batch) -> str:
    """The optimised HLO of the train step as the strategy compiles it (collectives included)."""
    step_fn = self.compiled.train(state)
    return step_fn.lower(state, self.strategy.put_batch(example_batch)).compile().as_text()

  def step_of(self, state: TrainState) -> int:
    """The host value of the state's step (all members step together)."""
    return int(np.ravel(self.strategy.to_canonical(state.step))[0])

  def evaluate(self, state: TrainState, batches: Iterable[Batch]) -> dict[str, float]:
    """Eval metrics over all `batches`, of any size (`trainer.evaluation.Evaluator`)."""
    return self.evaluator.evaluate(state, batches)

  def predict(self, state: TrainState, batch: Batch) -> np.ndarray:
    """Host predictions for a batch of any size (ensemble means for ensembles)."""
    return self.evaluator.predict(state, batch)

  def fit(self,
          train_batches: Callable[[int], Iterable[Batch]] | Iterable[Batch] | DeviceData, *,
          num_steps: int, state: TrainState | None = None,
          eval_batches: Callable[[], Iterable[Batch]] | None = None,
          writer: metric_writers.MetricWriter | None = None,
          checkpointer: Checkpointer | None = None, actions: Iterable[Action] = (),
          workdir: str | None = None) -> FitResult:
    """Trains until `state.step == num_steps` (or an action stops it), running the actions.

    With a `checkpointer`, a run whose directory holds a complete checkpoint
    resumes from the latest one (no flag needed): state, data position and
    the actions' state, restored in one call.

    Args:
      train_batches: `start_step -> iterable of host batches`, where batch i is
        the batch for step `start_step + i` (needed to resume), or an iterable
        consumed one batch per step from the state's current step. Each batch
        holds this process's rows (`strategy.process_slice(batch_size)`: all
        of them on one process). An iterator with `get_state`/`set_state`
        (Grain's) has its position saved with each checkpoint and restored
        on resume. Or a `DeviceData` (`config.data.pipeline = "device"`): the
        split is placed on the devices and each step gathers its batch in
        the compiled call; its position is the step.
      num_steps: the step to stop at.
      state: the state to continue from; else restored from `checkpointer`,
        else created from `config.seed`.
      eval_batches: returns a fresh iterable of eval batches for each evaluation
        (every `eval_every_steps` and at the last step).
      writer: where scalars go; console logging if None.
      checkpointer: where checkpoints are saved and resumed from.
      actions: the user's actions, run before the checkpoint.
      workdir: where a profile trace goes (`config.profile`).

    Returns:
      A `FitResult`: the final state, the evaluations, why the run stopped.

    Raises:
      ValueError: a train batch does not hold `config.batch_size` examples
        (raised before that step runs), a hook's output has the wrong shape
        (raised while the steps are traced, before training), or `num_steps`
        runs past a decaying schedule.
      BatchKeyError: a hook reads a batch entry the batch does not have.
      NonFiniteError: a step's loss or gradient norm was not finite under
        `nonfinite='stop'`; no checkpoint of a non-finite state is written.
      CheckpointError: a checkpoint could not be read, restored or written.
    """
    if type(self).build_schedule is Trainer.build_schedule:  # The config's schedule.
      check_run_length(self.config, self.num_train_steps, num_steps)
    run_actions = actions_lib.with_user_actions(
        self.default_actions(checkpointer=checkpointer, eval_batches=eval_batches,
                             workdir=workdir, writer=writer), list(actions))
    resume_step = checkpointer.latest_step() if checkpointer and state is None else None
    start = resume_step or (self.step_of(state) if state is not None else 0)
    device_data = train_batches if isinstance(train_batches, DeviceData) else None
    if device_data is not None:
      batches = None
      batch = device_data.example_batch(self.strategy.process_slice(self.config.batch_size))
    else:
      batches = self._train_iterator(train_batches, start, resume_step, checkpointer)
      batch = next(batches)
    self._check_train_batch(batch, start)
    if resume_step:
      state, batch = self._resume(checkpointer, resume_step, batches, batch, run_actions)
    elif state is None:
      state = self.init_state(batch)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    tokens = self.tokens_per_example(batch)
    self.tokens_per_step = tokens * self.config.batch_size if tokens else None
    self.step_flops = throughput.StepFlops(  # Counted when first logged.
        self.compiled.train(state), lambda: (abstract, self.strategy.put_batch(batch)),
        num_devices=self.strategy.num_devices)
    if logging.getLogger().isEnabledFor(logging.INFO):  # The summary reads every shard.
      logging.info("Strategy %s\n  %s", summarize(self.strategy, state),
                   self.step_flops.describe())
    # Eval and predict are traced now, so that a mistake in them stops the run
    # before it trains rather than at the first evaluation.
    self.evaluator.trace(state, batch, eval_batches)
    clock = next((a.clock for a in run_actions if isinstance(a, actions_lib.ReportMetrics)),
                 LoopClock())
    chunked = self.steps_per_call > 1 or device_data is not None
    plan = (ChunkPlan(self.steps_per_call, start=start, num_steps=num_steps,
                      actions=run_actions) if chunked else None)
    if device_data is not None:
      advance = self._device_data_calls(state, device_data, plan)
    else:
      advance = self._host_batch_calls(state, itertools.chain([batch], batches), start,
                                       num_steps, plan, batches, clock)
    steps_axis = self.strategy.steps_axis if chunked else None
    advance.compiles_at = self._compiles_at(plan)
    finite = driver.FiniteCheck(skip=self.recipe.skips_nonfinite, to_host=to_host,
                                which_models=models_named(self.strategy),
                                saved_note=lambda: _last_finite_checkpoint(checkpointer),
                                steps_axis=steps_axis)
    with _waiting_for_saves(checkpointer), self._watchdog(clock, checkpointer):
      result = driver.run(advance, state=state, start=start, num_steps=num_steps,
                          actions=run_actions, finite=finite,
                          canonical=self.strategy.to_canonical, steps_axis=steps_axis,
                          clock=clock)
    if writer is not None:
      writer.flush()
    return result

  def _compiles_at(self, plan: ChunkPlan | None) -> Callable[[int], bool]:
    """`step -> whether the call from step compiles`: the first call of each length."""
    seen: set[int] = set()

    def compiles_at(step: int) -> bool:
      size = plan.size(step) if plan else 1
      new = size not in seen
      seen.add(size)
      return new

    return compiles_at

  @contextlib.contextmanager
  def _watchdog(self, clock: LoopClock, checkpointer: Checkpointer | None):
    """A `Watchdog` on the loop while it runs, if `config.watchdog_seconds` is set."""
    seconds = self.config.watchdog_seconds
    if not seconds:
      yield
      return
    watchdog = Watchdog(seconds, self.config.watchdog_slow_seconds or 10 * seconds,
                        cleanup=checkpointer.remove_partial if checkpointer else lambda: None)
    clock.watchdog = watchdog
    watchdog.start()
    try:
      yield
    finally:
      watchdog.stop()
      clock.watchdog = None

  def _host_batch_calls(self, state: TrainState, batches: Iterator[Batch], start: int,
                        num_steps: int, plan: ChunkPlan | None,
                        source: Any, clock: LoopClock) -> driver.Advance:
    """`advance` for host batches: each call's batches checked and placed ahead of it
    (`DeviceFeed`); one step a call, or `plan`'s chunks stacked into one call."""
    feed = DeviceFeed(batches, start, check=self._check_train_batch,
                      put=self.strategy.put_batches if plan else self.strategy.put_batch,
                      ahead=self.prefetch, stop_step=num_steps,
                      state_of=source.get_state if is_checkpointable(source) else None,
                      sizes=plan.size if plan else None)
    call = self.compiled.train_chunk(state) if plan else self.compiled.train(state)

    def advance(state, step):
      with clock.measure("data"):
        placed, data_state = feed.next()
      state, outputs = call(state, placed, None) if plan else call(state, placed)
      with clock.measure("data"):
        feed.fill()  # The next batches are read and placed while this call runs.
      return state, outputs, step + feed.last_steps, data_state

    return advance

  def _device_data_calls(self, state: TrainState, data: DeviceData,
                         plan: ChunkPlan) -> driver.Advance:
    """`advance` for a device-resident dataset: the host only dispatches each call."""
    source = DeviceSource(data, self.strategy, self.steps_per_call)
    calls = {n: self.compiled.train_chunk(state, data=data, num_steps=n) for n in plan.sizes}
    logging.info("Train data on the devices: %d examples, %.1f MB per device",
                 data.num_examples, data.nbytes / 2**20)

    def advance(state, step):
      n = plan.size(step)
      call = calls.get(n) or self.compiled.train_chunk(state, data=data, num_steps=n)
      state, outputs = call(state, None, source.inputs(step))
      return state, outputs, step + n, None

    return advance

  def _resume(self, checkpointer: Checkpointer, step: int, batches: Iterator[Batch] | None,
              batch: Batch, actions: list[Action]) -> tuple[TrainState, Batch]:
    """Restores the run saved at `step` in one call: the state, the data position (the
    first batch is read again from there) and the actions' state."""
    run = self.restore_run(checkpointer, batch, step=step)
    if run.data is not None and is_checkpointable(batches):
      batches.set_state(run.data)  # The batch read before was only for the shapes.
      batch = next(batches)
    for action in actions:
      if action.name in run.actions:
        action.load_state_dict(run.actions[action.name])
    logging.info("Resuming at step %d from %s", step, checkpointer.step_dir(step))
    return run.state, batch

  def _train_iterator(self, train_batches, start: int, resume_step: int | None,
                      checkpointer: Checkpointer | None) -> Iterator[Batch]:
    if callable(train_batches):
      return iter(train_batches(start))
    if resume_step:
      raise ValueError(
          f"resuming from checkpoint step {resume_step} in {checkpointer.directory} needs "
          f"train_batches as a function start_step -> batches, so the data order continues "
          f"where the checkpoint left it.")
    return iter(train_batches)

  def _check_train_batch(self, batch: Batch, step: int) -> None:
    check_train_batch(batch, step, batch_size=self.config.batch_size,
                      rows=self.strategy.process_slice(self.config.batch_size))

  # -- Sweeps ------------------------------------------------------------------

  def finish_sweep(self, state: TrainState, step: int, results: list[dict[str, float]],
                   best: int, workdir: str | None) -> None:
    """A sweep's summary: a table in the log; with a `workdir`, `sweep.json`, `sweep.png`
    (the metric against each swept hyperparameter) and the best member as a single-model
    checkpoint in `<workdir>/sweep_best` (its config beside it, `sweep_best_config.json`)."""
    rows = summary_rows(self.sweep, results)
    names = list(results[0])
    logging.info("Sweep at step %d, best member %d (%s):\n%s", step, best,
                 self.sweep.label(best), format_table(rows, ["label", *names]))
    if not workdir or jax.process_index() > 0:
      return
    os.makedirs(workdir, exist_ok=True)
    metric = self.config.sweep.metric or names[0]
    with open(os.path.join(workdir, "sweep.json"), "w") as f:
      json.dump({"step": step, "metric": metric, "mode": self.config.sweep.mode,
                 "best": rows[best], "members": rows}, f, indent=1)
    sweep_plot(rows, self.sweep.varied, metric, best, os.path.join(workdir, "sweep.png"))
    self.export_member(state, best, os.path.join(workdir, "sweep_best"))
    with open(os.path.join(workdir, "sweep_best_config.json"), "w") as f:
      f.write(self.sweep.member_config(self.config, best).to_json(indent=1))

  def export_member(self, state: TrainState, member: int, directory: str) -> None:
    """Writes sweep member `member` as a single-model checkpoint in `directory`: it restores
    under any single-model strategy built from `sweep.member_config(config, member)`, and a
    run there resumes from it (the optimizer state in that config's layout)."""
    from strategies.single_device import SingleDevice
    one = jax.tree.map(lambda x: x[member], self.strategy.to_canonical(state))
    config = self.sweep.member_config(self.config, member)
    schedule = create_schedule(config, self.num_train_steps)
    plain = (grouped_optimizer(config, schedule, labels=self.parameter_labels)
             if self._groups_parameters else create_optimizer(config, schedule))
    one = one.replace(opt_state=single_model_opt_state(one.opt_state, plain.init(one.params)))
    if getattr(one, "ema_decay", None) is not None:  # A fixed decay there: from its config.
      one = one.replace(ema_decay=None)
    strategy = SingleDevice()
    checkpointer = Checkpointer(directory, every_steps=0, async_save=False)
    try:
      save_run(checkpointer, strategy, RunState(jax.device_put(one, strategy.device),
                                                int(one.step)))
      checkpointer.wait()
    finally:
      checkpointer.close()
    logging.info("Sweep member %d (%s) exported to %s", member, self.sweep.label(member),
                 directory)

  # -- Checkpoints -------------------------------------------------------------

  def save_checkpoint(self, checkpointer: Checkpointer, state: TrainState, step: int, *,
                      metrics: Mapping[str, float] | None = None,
                      action_states: Mapping[str, Any] | None = None,
                      data_state: Any = None) -> None:
    """Starts an asynchronous save of `state` as checkpoint `step` (`save_run`)."""
    save_run(checkpointer, self.strategy, RunState(state, step, data=data_state,
                                                   actions=dict(action_states or {}),
                                                   metrics=metrics))

  def restore_run(self, checkpointer: Checkpointer, example_batch: Batch, *,
                  step: int | None = None, member: int | None = None) -> RunState:
    """Restores a run (state, data position, action states) written under any strategy:
    `trainer.checkpoint.restore_run` for this model, whose shapes `example_batch` gives."""
    abstract = jax.eval_shape(self.steps.init_fn(example_batch), jax.random.PRNGKey(0))
    return restore_run(checkpointer, self.strategy, abstract, step=step, member=member)

  def restore_checkpoint(self, checkpointer: Checkpointer, example_batch: Batch, *,
                         step: int | None = None, member: int | None = None) -> TrainState:
    """The train state of `restore_run`."""
    return self.restore_run(checkpointer, example_batch, step=step, member=member).state


def _last_finite_checkpoint(checkpointer: Checkpointer | None) -> str:
  """Which checkpoint holds the last finite state, once the last save is on disk."""
  if not checkpointer:
    return "no checkpoint was written"
  checkpointer.wait()
  latest = checkpointer.latest_step()
  if latest is None:
    return "no checkpoint was written"
  return f"the latest checkpoint is step {latest} in {checkpointer.directory}"


@contextlib.contextmanager
def _waiting_for_saves(checkpointer: Checkpointer | None):
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
