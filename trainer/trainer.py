"""The Trainer: the hooks a research project overrides, and the parts composed from them.

A research project subclasses `Trainer`, supplies a Flax module
(`build_model`) and a per-example loss (`loss`), and may override any other
hook below. The constructor checks the config (`trainer.config.check_config`)
and builds every part once, from the config and the hooks:

- `strategy` (`strategies`): device layout, compilation, collectives;
- `recipe` (`trainer.step.recipe`): the step transforms;
- `steps` and `compiled` (`trainer.step.functions`): the pure init, train, eval
  and predict functions built from the hooks, and their compiled forms;
- `evaluator` (`trainer.evaluation`): eval and predict over batches of any size;
- `states` (`trainer.run.state`): a new placed state, or a restored one;
- `runner` (`trainer.run`): what `fit` does: resume, feed, call, act, report;
- `sweep` (`trainer.sweep`): a sweep's members, when `config.sweep` has any.

The Trainer never touches devices, runs the loop or validates a field itself.
"""

from __future__ import annotations

import abc
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import optax
from clu import metrics as clu_metrics

from models.attention import Method as AttentionMethod
from trainer import metrics as metrics_lib
from trainer import sweep as sweep_lib
from trainer.checkpoint import Checkpointer
from trainer.config import check_config
from trainer.evaluation import MASK_KEY, Evaluator
from trainer.loop import builtin
from trainer.loop.actions import Action, FitResult
from trainer.run.options import RunOptions
from trainer.run.runner import Runner
from trainer.run.start import TrainData
from trainer.run.state import States
from trainer.step import model_variables
from trainer.step.functions import CompiledSteps, StepFunctions
from trainer.step.lora import Lora
from trainer.step.optim import (
  check_run_length,
  create_schedule,
  frozen_patterns,
  optimizer_for,
  parameter_labels,
)
from trainer.step.recipe import Recipe, recipe_from_config
from trainer.step.remat import Remat
from trainer.step.train_state import TrainState

if TYPE_CHECKING:  # Only annotations: clu's writers import TensorFlow (seconds).
  from clu import metric_writers

Batch = Mapping[str, Any]
PyTree = Any

#: Attributes and methods the Trainer no longer has, and where each went (internal: kept out
#: of the API reference; `Trainer.__getattr__` names the new place).
_MOVED = {
    "finish_sweep": "trainer.sweep.summarize (the sweep's report calls it at a run's end)",
    "export_member": "trainer.sweep.export_member(state, member, directory, "
                     "sweep=trainer.sweep, config=trainer.config, strategy=trainer.strategy, "
                     "num_train_steps=trainer.num_train_steps, labels=trainer.labels)",
    "compiled_train_step": "trainer.compiled.train(state)",
    "compiled_train_step_text": "trainer.compiled.train_text(state, example_batch)",
    "step_of": "trainer.run.start.step_of(state, trainer.strategy)",
    "save_checkpoint": "trainer.checkpoint.save_run(checkpointer, trainer.strategy, "
                       "RunState(state, step))",
    "step_flops": "fit's result: FitResult.step_flops",
    "tokens_per_step": "StepView.tokens_per_step, what an action sees",
    "steps_per_call": "trainer.runner.options.steps_per_call",
    "prefetch": "trainer.runner.options.prefetch",
    "init_source": "trainer.states.source",
    "restore_run": "trainer.states.restore(checkpointer, example_batch, step=..., member=...)",
}


class Trainer(abc.ABC):
  """Trains one Flax module under the strategy named in `config.strategy.name`.

  Required hooks: `build_model` (a Linen module, or a factory of an NNX one)
  and `loss`; the others have defaults. The model's variables are
  `state.params` and `state.model_state` (every other collection, e.g.
  `batch_stats`). The train step calls the model in training mode, eval and
  predict in eval mode; each RNG stream's key derives from
  `fold_in(state.rng, step)` (and the replica index where a step sees a shard).

  Attributes:
    input_key: the batch entry passed to the model by the default `model_inputs`.
    target_key: the batch entry holding targets, for losses and metrics.
    rng_streams: the named RNG streams the model draws from (Linen
      `make_rng(name)`, NNX `rngs.name`); add any stream your model asks for.
  """

  input_key: str = "inputs"
  target_key: str = "targets"
  rng_streams: tuple[str, ...] = ("dropout",)

  # -- The model and its loss (required) ---------------------------------------------

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

  # -- How the model is called --------------------------------------------------------

  def model_inputs(self, batch: Batch, *, train: bool,
                   rngs: Mapping[str, jax.Array]) -> tuple[tuple, dict]:
    """`(args, kwargs)` the model is called with on `batch`: `(batch[input_key],), {}`.

    Override for several inputs (`(batch['inputs'], batch['targets']), {}`) or
    an RNG argument (`rngs['z']`, with 'z' in `rng_streams`). The mode
    arguments the module declares (`train`, `deterministic`) are added unless
    given here, and an NNX module whose `__call__` takes `rngs` gets them
    unless `args` or `kwargs` already bind it.
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

    A pytree (it passes into `jax.jit`); reading a stream that is not in
    `rng_streams` raises an error naming it.
    """
    return model_variables.RngStreams(
        {name: jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
         for name in self.rng_streams})

  # -- Metrics and predictions --------------------------------------------------------

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

  def tokens_per_example(self, batch: Batch) -> int | None:
    """Tokens in one example of `batch`, for `train/tokens_per_sec`; None: not a token
    model (`LanguageModelTrainer` counts its targets)."""
    del batch
    return None

  # -- Optimization ---------------------------------------------------------------

  def build_schedule(self) -> optax.Schedule | None:
    """`step -> learning rate`, logged as `train/learning_rate`; from `config.schedule`.

    Return None if `build_optimizer` makes its own learning rates (a sweep's are per
    member, in each member's optimizer state).
    """
    if self.sweep is not None:
      return None
    return create_schedule(self.config, self.num_train_steps)

  def build_optimizer(self) -> optax.GradientTransformation:
    """The optax optimizer: by default the config's (`trainer.step.optim.optimizer_for`)
    with `self.schedule`.

    The default clips by `grad_clip_norm` and decays the weights that
    `trainer.step.optim.default_decay_mask` selects (not biases or norm scales).
    Under `config.sweep` the same chain takes each member's hyperparameters from
    its state (`trainer.sweep.swept_optimizer`). Parameters are grouped (frozen,
    `config.param_groups`) when `self.labels` is set.
    """
    if self.sweep is not None:
      return sweep_lib.swept_optimizer(self.config, self.sweep, self.num_train_steps,
                                       labels=self.labels)
    return optimizer_for(self.config, self.schedule, labels=self.labels)

  def parameter_labels(self, params: PyTree) -> PyTree:
    """Each parameter's group: `'frozen'`, `'group<i>'` (`config.param_groups[i]`) or
    `'default'`; by default from the config's path patterns. Override to choose in code
    (e.g. by shape); it is called with the parameters while the state is built."""
    return parameter_labels(params, freeze=frozen_patterns(self.config),
                            groups=[dict(g) for g in self.config.param_groups])

  def learning_rate(self, step: int) -> float | None:
    """The learning rate of the update from `step` to `step + 1`, or None if unknown."""
    return None if self.schedule is None else float(self.schedule(step))

  def build_recipe(self) -> Recipe:
    """The step transforms, in order: the config's (`recipe_from_config`) by default.

    Override to add one the config cannot express (SAM, dynamic loss scaling):
    `return super().build_recipe() + [MyTransform()]`.
    """
    return recipe_from_config(self.config, num_data_replicas=self.strategy.num_data_replicas,
                              strategy_name=self.strategy.name)

  def create_train_state(self, *, params: PyTree, model_state: PyTree,
                         rng: jax.Array) -> TrainState:
    """The initial state of one model; the recipe adds what it keeps (EMA parameters)."""
    return TrainState.create(apply_fn=self.model_variables.apply, params=params,
                             model_state=model_state, tx=self.optimizer, rng=rng)

  # -- The steps themselves -------------------------------------------------------

  def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, PyTree]:
    """One optimizer update (`trainer.step.functions.StepFunctions.train`)."""
    return self.steps.train(state, batch)

  def eval_step(self, state: TrainState, batch: Batch) -> PyTree:
    """Metrics of one padded eval batch."""
    return self.steps.eval(state, batch)

  def predict_step(self, state: TrainState, batch: Batch) -> jax.Array:
    """Predictions, averaged over ensemble members where there are several."""
    return self.steps.predict(state, batch)

  # -- The loop's side effects ----------------------------------------------------

  def default_actions(self, *, checkpointer: Checkpointer | None,
                      eval_batches: Callable[[], Iterable[Batch]] | None,
                      workdir: str | None,
                      writer: metric_writers.MetricWriter | None = None) -> list[Action]:
    """The loop's built-in actions the config asks for (`trainer.loop.builtin.from_config`),
    with a sweep's report after the evaluation (`trainer.sweep.actions`).

    Override to reorder or replace them; `fit(actions=...)` adds to them.

    Raises:
      ValueError: an early-stopping or profile setting that cannot work (before any step).
    """
    if writer is None:
      from trainer.writers import LoggingWriter
      writer = LoggingWriter()
    if self.sweep is not None and eval_batches is not None:
      # The sweep's report evaluates each member right after `Evaluate`: one eval pass.
      eval_batches = self.evaluator.one_set(eval_batches)
    after_eval = [] if self.sweep is None else sweep_lib.actions(
        self.sweep, self.config, strategy=self.strategy, writer=writer,
        evaluate_members=self.evaluator.evaluate_members, eval_batches=eval_batches,
        workdir=workdir, num_train_steps=self.num_train_steps, labels=self.labels,
        init_members=self.states.init_members)
    return builtin.from_config(
        self.config, writer=writer, strategy=self.strategy, recipe=self.recipe,
        evaluate=self.evaluate, learning_rate=self.learning_rate, checkpointer=checkpointer,
        eval_batches=eval_batches, workdir=workdir, after_eval=after_eval)

  # -- The parts, composed once ---------------------------------------------------

  def __init__(self, config: ml_collections.ConfigDict, *, strategy: Any = None,
               num_train_steps: int | None = None):
    """Checks the config (`trainer.config.check_config`), then builds the parts.

    Args:
      config: the run's config.
      strategy: overrides the one `config.strategy` names.
      num_train_steps: the run's length, which a decaying schedule needs
        (default: `config.num_train_steps` when that is positive).

    Raises:
      ValueError: naming a field no part accepts, before any compute.
    """
    if num_train_steps is None and config.num_train_steps > 0:
      num_train_steps = config.num_train_steps
    check_config(config)
    self.config, self.num_train_steps = config, num_train_steps
    self.sweep = sweep_lib.Sweep.from_config(config)
    self.strategy = strategy = sweep_lib.strategy_for(config, self.sweep, strategy)
    strategy.check_batch_size(config.batch_size)
    overridden = type(self).parameter_labels is not Trainer.parameter_labels
    #: `parameter_labels` when parameters are grouped (config patterns, or the hook
    #: overridden), else None.
    self.labels = (self.parameter_labels if config.freeze or config.param_groups or overridden
                   or config.lora.rank else None)
    self.recipe = self.build_recipe()
    self.compiled = CompiledSteps(self, strategy, steps_loop=config.steps_loop)
    self.evaluator = Evaluator(strategy, self.compiled, config.eval_batch_size)
    self.schedule = self.build_schedule()
    self.model = self.build_model()
    self.model_variables = model_variables.create(self.model,
                                                  sync_batchnorm=config.sync_batchnorm,
                                                  remat=Remat.from_config(config),
                                                  lora=Lora.from_config(config),
                                                  attention=AttentionMethod.from_config(config))
    self.optimizer = self.build_optimizer()
    self.steps = StepFunctions(self, strategy, self.model_variables.init, self.recipe)
    self.states = States(config, steps=self.steps, strategy=strategy, recipe=self.recipe,
                         create_train_state=self.create_train_state, sweep=self.sweep,
                         linen=self.model_variables.linen)
    self.runner = Runner(options=RunOptions.from_config(config), strategy=strategy,
                         compiled=self.compiled, evaluator=self.evaluator, states=self.states,
                         batch_size=config.batch_size,
                         skips_nonfinite=self.recipe.skips_nonfinite,
                         tokens_per_example=self.tokens_per_example)

  def __getattr__(self, name: str) -> Any:
    if name in _MOVED:
      raise AttributeError(f"Trainer.{name} moved out of the Trainer: use {_MOVED[name]}.")
    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

  # -- Running (each is a part's) -------------------------------------------------

  def init_state(self, example_batch: Batch, rng: jax.Array | None = None) -> TrainState:
    """A new placed state for batches shaped like `example_batch` (`trainer.run.States`);
    `rng` defaults to `PRNGKey(config.seed)`."""
    return self.states.init(example_batch, rng)

  def fit(self, train_batches: TrainData, *, num_steps: int, state: TrainState | None = None,
          eval_batches: Callable[[], Iterable[Batch]] | None = None,
          writer: metric_writers.MetricWriter | None = None,
          checkpointer: Checkpointer | None = None, actions: Iterable[Action] = (),
          workdir: str | None = None) -> FitResult:
    """Trains until `state.step == num_steps` (or an action stops it), running
    `default_actions` and then `actions` (before the checkpoint): `trainer.run.Runner.fit`.
    With a `checkpointer` that holds a complete checkpoint, it resumes from the latest.

    Args:
      train_batches: `start_step -> iterable of host batches` (what a resumed run
        needs: batch i is step `start_step + i`'s), an iterable of host batches,
        or a `trainer.data.DeviceData` on the devices (`trainer.run.start.TrainData`).
        Each host batch holds this process's rows (`strategy.process_slice`).
      num_steps: the step to stop at (a halving sweep's: each trial's length).
      state: the state to continue from; else restored from `checkpointer`,
        else created from `config.seed`.
      eval_batches: returns a fresh iterable of eval batches for each evaluation.
      writer: where scalars go; console logging if None.
      checkpointer: where checkpoints are saved and resumed from.
      actions: the user's actions (`trainer.Action`).
      workdir: where a profile trace and a sweep's summary go; the run locks it (else
        the checkpoint directory) against a second run (`trainer.run.lock`).

    Returns:
      A `FitResult`: final state, evaluations, why it stopped, the step's FLOPs.

    Raises:
      ValueError: a batch, a hook's output or `num_steps` that cannot work, before
        the step it would break.
      NonFiniteError: a non-finite loss or gradient norm under `nonfinite='stop'`.
      CheckpointError: a checkpoint could not be read, restored or written.
      WorkdirInUseError: another run holds the lock of `workdir`.
    """
    if type(self).build_schedule is Trainer.build_schedule:  # The config's schedule.
      check_run_length(self.config, self.num_train_steps, num_steps)
    defaults = self.default_actions(checkpointer=checkpointer, eval_batches=eval_batches,
                                    workdir=workdir, writer=writer)
    num_steps = sweep_lib.program_steps(self.sweep, self.strategy, num_steps)  # Halving: more.
    return self.runner.fit(train_batches, num_steps=num_steps, state=state,
                           actions=builtin.with_user_actions(defaults, list(actions)),
                           eval_batches=eval_batches, writer=writer, checkpointer=checkpointer,
                           workdir=workdir)

  def evaluate(self, state: TrainState, batches: Iterable[Batch]) -> dict[str, float]:
    """Eval metrics over all `batches`, of any size (`trainer.evaluation.Evaluator`)."""
    return self.evaluator.evaluate(state, batches)

  def predict(self, state: TrainState, batch: Batch) -> np.ndarray:
    """Host predictions for a batch of any size: the `prediction` hook of the outputs,
    probabilities by default (a softmax, not the logits); the members' mean for an
    ensemble."""
    return self.evaluator.predict(state, batch)

  def restore_checkpoint(self, checkpointer: Checkpointer, example_batch: Batch, *,
                         step: int | None = None, member: int | None = None) -> TrainState:
    """The train state saved at `step` (None: the latest) under any strategy, in this
    strategy's layout; `member`: one member of a saved ensemble (`trainer.run.States`)."""
    return self.states.restore(checkpointer, example_batch, step=step, member=member).state
