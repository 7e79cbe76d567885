"""The Trainer: one training loop, step functions written once, hooks to override.

A research project subclasses `Trainer`, supplies a Flax module
(`build_model`) and a per-example loss (`loss`), and may override the
optimizer, the metrics, how the model is applied, and the eval step. The
Trainer never touches devices: the `Strategy` built from `config.strategy`
places state and batches, compiles the steps, and provides the collectives
that the steps call (`mean_over_data`, `mean_over_members`, ...), which are
identities on a single device.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from clu import metric_writers
from clu import metrics as clu_metrics

from strategies import Strategy, create_strategy
from trainer import metrics as metrics_lib
from trainer.checkpoint import Checkpointer, CheckpointError
from trainer.optim import create_optimizer
from trainer.train_state import TrainState

Batch = Mapping[str, Any]
PyTree = Any

MASK_KEY = "mask"

#: What `config.nonfinite` may say a train step does with a non-finite loss or gradient.
NONFINITE_ACTIONS = ("stop", "skip")


class NonFiniteError(FloatingPointError):
  """A train step produced a non-finite loss or gradient norm under `nonfinite='stop'`."""


def _models(num_members: int) -> str:
  return f"{num_members} models" if num_members else "a single model"


class _StopRequest:
  """Records a termination signal so the loop can stop between steps."""

  def __init__(self):
    self.signum: int | None = None

  def __call__(self, signum, frame):
    del frame
    self.signum = signum

  @contextlib.contextmanager
  def installed(self, signals: tuple[int, ...]):
    """Handles `signals` for the duration; outside the main thread this is a no-op."""
    if threading.current_thread() is not threading.main_thread():
      yield self
      return
    previous = {s: signal.signal(s, self) for s in signals}
    try:
      yield self
    finally:
      for s, handler in previous.items():
        signal.signal(s, handler)


def pad_batch(batch: Batch, size: int) -> dict[str, np.ndarray]:
  """Pads a host batch to `size` examples and adds a 0/1 `mask` of the real ones.

  Raises:
    ValueError: the batch is larger than `size`.
  """
  n = len(next(iter(batch.values())))
  if n > size:
    raise ValueError(f"an eval batch of {n} examples exceeds the eval batch size {size}")
  padded = {k: np.concatenate([np.asarray(v), np.zeros((size - n,) + np.shape(v)[1:],
                                                        np.asarray(v).dtype)])
            for k, v in batch.items() if k != MASK_KEY}
  mask = np.asarray(batch.get(MASK_KEY, np.ones(n)), np.float32)
  padded[MASK_KEY] = np.concatenate([mask, np.zeros(size - n, np.float32)])
  return padded


class Trainer(abc.ABC):
  """Trains one Flax module under the strategy named in `config.strategy.name`.

  Required hooks: `build_model` and `loss`. Optional hooks: `build_optimizer`,
  `apply_model`, `train_metrics`, `eval_metrics`, `prediction`.

  Config fields read here: `seed`, `batch_size`, `eval_batch_size` (defaults
  to `batch_size`), `log_every_steps`, `eval_every_steps`, `nonfinite`,
  `strategy.*`, and the optimizer fields read by `trainer.optim.create_optimizer`.

  Attributes:
    input_key: the batch entry passed to the model by the default `apply_model`.
    target_key: the batch entry holding targets, for losses and metrics.
  """

  input_key: str = "inputs"
  target_key: str = "targets"

  def __init__(self, config: ml_collections.ConfigDict, *, strategy: Strategy | None = None):
    """Builds strategy, model and optimizer, validating the config before any compute.

    Raises:
      ValueError: an unknown strategy or optimizer, a mesh or rule table that
        does not fit the devices, or a batch size that does not split evenly.
    """
    self.config = config
    self.strategy = strategy if strategy is not None else create_strategy(config)
    self.strategy.check_batch_size(config.batch_size)
    self.eval_batch_size = config.get("eval_batch_size", config.batch_size)
    self.strategy.check_batch_size(self.eval_batch_size, field="eval_batch_size")
    self.nonfinite = config.get("nonfinite", "stop")
    if self.nonfinite not in NONFINITE_ACTIONS:
      raise ValueError(f"config.nonfinite={self.nonfinite!r} is not one of "
                       f"{NONFINITE_ACTIONS}: 'stop' raises at the first non-finite loss or "
                       f"gradient norm, 'skip' leaves such updates out and counts them.")
    self.model = self.build_model()
    self.optimizer = self.build_optimizer()
    self._compiled: dict[str, Callable] = {}
    #: (step, results) of every evaluation `fit` ran, oldest first.
    self.eval_history: list[tuple[int, dict[str, float]]] = []
    #: Steps whose update `nonfinite='skip'` left out, in this process.
    self.skipped_steps = 0
    #: The signal that stopped the last `fit` early (after saving), or None.
    self.stopped_by: int | None = None

  # -- Hooks a research project overrides ------------------------------------

  @abc.abstractmethod
  def build_model(self) -> nn.Module:
    """The Flax module to train."""

  @abc.abstractmethod
  def loss(self, outputs: Any, batch: Batch) -> jax.Array:
    """Per-example losses, shape [batch], for the model's outputs on `batch`."""

  def build_optimizer(self) -> optax.GradientTransformation:
    """The optax optimizer; by default built from the config's optimizer fields."""
    return create_optimizer(self.config)

  def apply_model(self, params: PyTree, batch: Batch, *, rngs: dict[str, jax.Array] | None,
                  train: bool) -> Any:
    """Runs the model on one (per-replica) batch; override to pass `train` or more inputs."""
    del train  # The default modules behave the same in training and evaluation.
    return self.model.apply({"params": params}, batch[self.input_key], rngs=rngs)

  def train_metrics(self, outputs: Any, batch: Batch, loss: jax.Array) -> clu_metrics.Collection:
    """Metrics of one training step, from the per-example losses."""
    del outputs, batch
    return metrics_lib.LossMetrics.single_from_model_output(loss=loss)

  def eval_metrics(self, outputs: Any, batch: Batch) -> clu_metrics.Collection:
    """Metrics of one eval batch; `batch['mask']` marks the real (unpadded) examples."""
    return metrics_lib.LossMetrics.single_from_model_output(
        loss=self.loss(outputs, batch), mask=batch[MASK_KEY])

  def prediction(self, outputs: Any) -> jax.Array:
    """What an ensemble averages over members: class probabilities by default."""
    return jax.nn.softmax(outputs, axis=-1)

  # -- Pure step functions (single-replica terms; compiled by the strategy) --

  def init_fn(self, example_batch: Batch) -> Callable[[jax.Array], TrainState]:
    """`rng -> TrainState` for a model fed batches shaped like `example_batch`."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                          dict(example_batch))

    def init(rng: jax.Array) -> TrainState:
      params_rng, state_rng = jax.random.split(rng)
      zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      variables = self.model.init({"params": params_rng}, zeros[self.input_key])
      return TrainState.create(apply_fn=self.model.apply, params=variables["params"],
                               tx=self.optimizer, rng=state_rng)

    return init

  def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, PyTree]:
    """One optimizer update: `(state, batch) -> (state, {'metrics', 'finite'})`.

    `finite` says whether the mean loss and the gradient norm were finite;
    with `nonfinite='skip'` a non-finite step keeps the old parameters and
    optimizer state (the step counter still advances, so data stays aligned).
    """
    rng = self.strategy.replica_rng(jax.random.fold_in(state.rng, state.step))

    def loss_fn(params):
      outputs = self.apply_model(params, batch, rngs={"dropout": rng}, train=True)
      per_example = self.loss(outputs, batch)
      return jnp.mean(per_example), (per_example, outputs)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (mean_loss, (per_example, outputs)), grads = grad_fn(state.params)
    grads = self.strategy.mean_over_data(grads)
    finite = (jnp.isfinite(self.strategy.mean_over_data(mean_loss))
              & jnp.isfinite(optax.tree.norm(grads)))
    new_state = state.apply_gradients(grads=grads)
    if self.nonfinite == "skip":
      kept = state.replace(step=new_state.step)
      new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, kept)
    metrics = self.strategy.merge_metrics_over_data(
        self.train_metrics(outputs, batch, per_example))
    return new_state, {"metrics": metrics, "finite": finite}

  def eval_step(self, state: TrainState, batch: Batch) -> PyTree:
    """Metrics of one padded eval batch."""
    outputs = self.apply_model(state.params, batch, rngs=None, train=False)
    return self.strategy.merge_metrics_over_data(self.eval_metrics(outputs, batch))

  def predict_step(self, state: TrainState, batch: Batch) -> jax.Array:
    """Predictions, averaged over ensemble members where there are several."""
    outputs = self.apply_model(state.params, batch, rngs=None, train=False)
    return self.strategy.mean_over_members(self.strategy.whole_batch(self.prediction(outputs)))

  # -- Running -----------------------------------------------------------------

  def init_state(self, example_batch: Batch, rng: jax.Array | None = None) -> TrainState:
    """Creates the placed train state; `rng` defaults to `PRNGKey(config.seed)`."""
    if rng is None:
      rng = jax.random.PRNGKey(self.config.seed)
    return self.strategy.create_state(self.init_fn(example_batch), rng)

  def _compile(self, name: str, fn: Callable, state: TrainState) -> Callable:
    """Compiles each step function once per Trainer."""
    if name not in self._compiled:
      compile_fn = (self.strategy.compile_train_step if name == "train"
                    else self.strategy.compile_eval_step)
      self._compiled[name] = compile_fn(fn, state)
    return self._compiled[name]

  def step_of(self, state: TrainState) -> int:
    """The host value of the state's step (all members step together)."""
    return int(np.ravel(self.strategy.to_canonical(state.step))[0])

  def fit(self, train_batches: Callable[[int], Iterable[Batch]] | Iterable[Batch], *,
          num_steps: int, state: TrainState | None = None,
          eval_batches: Callable[[], Iterable[Batch]] | None = None,
          writer: metric_writers.MetricWriter | None = None,
          checkpointer: Checkpointer | None = None) -> TrainState:
    """Trains until `state.step == num_steps`, logging, evaluating and checkpointing.

    With a `checkpointer`, a run whose directory holds a complete checkpoint
    resumes from the latest one (no flag needed); checkpoints are written
    every `checkpointer.every_steps` steps and at the end. On SIGTERM the
    current step finishes, a checkpoint is saved and written, and `fit`
    returns early with `self.stopped_by` set.

    Args:
      train_batches: `start_step -> iterable of host batches`, where batch i is
        the batch for step `start_step + i` (needed to resume), or an iterable
        consumed one batch per step from the state's current step.
      num_steps: the step to stop at.
      state: the state to continue from; else restored from `checkpointer`,
        else created from `config.seed`.
      eval_batches: returns a fresh iterable of eval batches for each evaluation;
        evaluations run every `eval_every_steps` and at the last step, and are
        appended to `self.eval_history`.
      writer: where scalars go; console logging if None.
      checkpointer: where checkpoints are saved and resumed from.

    Returns:
      The final state.

    Raises:
      NonFiniteError: a step's loss or gradient norm was not finite under
        `nonfinite='stop'`; no checkpoint of a non-finite state is written.
      CheckpointError: a checkpoint could not be read, restored or written.
    """
    writer = writer or metric_writers.LoggingWriter()
    resume_step = checkpointer.latest_step() if checkpointer and state is None else None
    start = resume_step or (self.step_of(state) if state is not None else 0)
    if callable(train_batches):
      batches: Iterator[Batch] = iter(train_batches(start))
    elif resume_step:
      raise ValueError(
          f"resuming from checkpoint step {resume_step} in {checkpointer.directory} needs "
          f"train_batches as a function start_step -> batches, so the data order continues "
          f"where the checkpoint left it.")
    else:
      batches = iter(train_batches)
    first = next(batches)
    if state is None:
      state = (self.restore_checkpoint(checkpointer, first, step=resume_step)
               if resume_step else self.init_state(first))
    if resume_step:
      logging.info("Resuming at step %d from %s", resume_step, checkpointer.step_dir(resume_step))
    if logging.getLogger().isEnabledFor(logging.INFO):  # The summary reads every shard.
      logging.info("Strategy %s", self.strategy.summary(state))
    step_fn = self._compile("train", self.train_step, state)
    log_every = self.config.get("log_every_steps", 100)
    eval_every = self.config.get("eval_every_steps", 0)

    self.stopped_by = None
    stop = _StopRequest()
    step = start
    pending: list[PyTree] = []  # Step metrics stay on device until the next log.
    unchecked: list[tuple[int, jax.Array]] = []  # The last step's finite flag, checked late.

    def settle():
      """Checks the flag still pending (blocking on its step)."""
      while unchecked:
        self._check_finite(*unchecked.pop(), checkpointer)

    batch, tick = first, time.perf_counter()
    signals = (signal.SIGTERM,) if checkpointer else ()
    with stop.installed(signals), self._waiting_for_saves(checkpointer):
      while step < num_steps:
        state, out = step_fn(state, self.strategy.put_batch(batch))
        step += 1
        settle()  # The previous step's flag: one step stays in flight.
        unchecked.append((step, out["finite"]))
        pending.append(out["metrics"])
        if step % log_every == 0 or step == num_steps:
          merged = metrics_lib.merge_all([self.strategy.metrics_to_host(m) for m in pending])
          scalars = {f"train/{k}": v for k, v in metrics_lib.scalars(merged).items()}
          scalars.update(self._progress(step, num_steps, len(pending), time.perf_counter() - tick))
          if self.nonfinite == "skip":
            settle()
            scalars["train/skipped_steps"] = self.skipped_steps
          writer.write_scalars(step, scalars)
          pending, tick = [], time.perf_counter()
        if checkpointer and (checkpointer.is_save_step(step) or step == num_steps
                             or stop.signum is not None):
          settle()  # Never save a state that is not finite.
          self.save_checkpoint(checkpointer, state, step)
        if stop.signum is not None:
          checkpointer.wait()
          self.stopped_by = stop.signum
          logging.warning("Stopped by %s at step %d of %d; checkpoint written to %s",
                          signal.Signals(stop.signum).name, step, num_steps,
                          checkpointer.step_dir(step))
          break
        if eval_batches is not None and (
            (eval_every and step % eval_every == 0) or step == num_steps):
          results = self.evaluate(state, eval_batches())
          self.eval_history.append((step, results))
          writer.write_scalars(step, {f"eval/{k}": v for k, v in results.items()})
          tick = time.perf_counter()
        if step < num_steps:
          batch = next(batches)
      settle()
    if step == start >= num_steps and eval_batches is not None:
      # Nothing left to train (a finished run restarted): evaluate the final state.
      self.eval_history.append((step, self.evaluate(state, eval_batches())))
    writer.flush()
    return state

  @contextlib.contextmanager
  def _waiting_for_saves(self, checkpointer: Checkpointer | None):
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

  def _check_finite(self, step: int, finite: jax.Array, checkpointer: Checkpointer | None):
    """Counts (`skip`) or raises (`stop`) if the step that produced `finite` was not."""
    ok = np.ravel(jax.device_get(finite))  # Per replica or per member.
    if ok.all():
      return
    members = (f" (ensemble member(s) {np.flatnonzero(~ok).tolist()})"
               if self.strategy.is_ensemble else "")
    if self.nonfinite == "skip":
      self.skipped_steps += 1
      logging.warning("Step %d%s: non-finite loss or gradient norm; update skipped "
                      "(%d so far)", step, members, self.skipped_steps)
      return
    if checkpointer:
      checkpointer.wait()  # The last save (of a finite state) completes first.
    latest = checkpointer.latest_step() if checkpointer else None
    saved = (f"the latest checkpoint is step {latest} in {checkpointer.directory}"
             if latest is not None else "no checkpoint was written")
    raise NonFiniteError(
        f"step {step}{members}: the loss or the gradient norm is not finite, so training "
        f"stopped (config.nonfinite='stop'; 'skip' would leave such updates out); "
        f"{saved}.")

  # -- Checkpoints -------------------------------------------------------------

  def checkpoint_layout(self) -> dict[str, Any]:
    """What a checkpoint records about its layout besides the arrays."""
    return {"num_members": self.strategy.num_members if self.strategy.is_ensemble else 0,
            "strategy": self.strategy.name}

  def save_checkpoint(self, checkpointer: Checkpointer, state: TrainState, step: int) -> None:
    """Starts an asynchronous save of `state` as checkpoint `step`."""
    checkpointer.save(step, self.strategy.checkpoint_state(state), self.checkpoint_layout())

  def restore_checkpoint(self, checkpointer: Checkpointer, example_batch: Batch, *,
                         step: int | None = None, member: int | None = None) -> TrainState:
    """Restores a checkpoint written under any strategy into this trainer's strategy.

    Args:
      example_batch: a batch shaped like the training batches (for the model's shapes).
      step: which checkpoint; the latest complete one if None.
      member: with an ensemble checkpoint and a single-model strategy, the
        member to restore.

    Raises:
      CheckpointError: no checkpoint, an unreadable one, a different model, or
        a member layout this strategy cannot hold.
    """
    step = checkpointer.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"no complete checkpoint in {checkpointer.directory}.")
    layout = checkpointer.layout(step)
    saved_members, where = layout["num_members"], checkpointer.step_dir(step)
    abstract = jax.eval_shape(self.init_fn(example_batch), jax.random.PRNGKey(0))
    target = self.strategy.checkpoint_target(abstract)
    ours = self.strategy.num_members if self.strategy.is_ensemble else 0
    if saved_members and not ours:
      if member is None or not 0 <= member < saved_members:
        raise CheckpointError(
            f"checkpoint {where} holds an ensemble of {saved_members} members and strategy "
            f"{self.strategy.name!r} holds one model; pass member=i with 0 <= i < "
            f"{saved_members} (got {member}) to restore one of them.")
      stacked = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
          (saved_members,) + x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(
              jax.local_devices()[0])), target)
      restored = checkpointer.restore(step, stacked)
      restored = jax.tree.map(lambda x, t: jax.device_put(x[member], t.sharding),
                              restored, target)
    elif saved_members != ours:
      raise CheckpointError(
          f"checkpoint {where} holds {_models(saved_members)} (written by "
          f"{layout.get('strategy')!r}) but strategy {self.strategy.name!r} holds "
          f"{_models(ours)}; an ensemble restores into an ensemble of the same size, or one "
          f"member of it into a single-model strategy.")
    else:
      restored = checkpointer.restore(step, target)
    # `restored` is a TrainState whose static fields (apply_fn, tx) are this trainer's.
    return self.strategy.from_checkpoint(restored)

  def _progress(self, step: int, num_steps: int, steps: int, seconds: float) -> dict[str, float]:
    """Throughput scalars for a log interval, and a console line with the ETA."""
    steps_per_sec = steps / max(seconds, 1e-9)
    examples_per_sec = steps_per_sec * self.config.batch_size
    eta = (num_steps - step) / steps_per_sec
    logging.info("step %d/%d: %.2f steps/s, %.0f examples/s, ETA %dm%02ds", step, num_steps,
                 steps_per_sec, examples_per_sec, eta // 60, eta % 60)
    return {"train/steps_per_sec": steps_per_sec, "train/examples_per_sec": examples_per_sec}

  def compiled_train_step_text(self, state: TrainState, example_batch: Batch) -> str:
    """The optimised HLO of the train step as the strategy compiles it (collectives included)."""
    step_fn = self._compile("train", self.train_step, state)
    return step_fn.lower(state, self.strategy.put_batch(example_batch)).compile().as_text()

  def evaluate(self, state: TrainState, batches: Iterable[Batch]) -> dict[str, float]:
    """Eval metrics over all `batches`, padding short ones and masking the padding."""
    step_fn = self._compile("eval", self.eval_step, state)
    outputs = [step_fn(state, self.strategy.put_batch(pad_batch(b, self.eval_batch_size)))
               for b in batches]
    return metrics_lib.scalars(
        metrics_lib.merge_all([self.strategy.metrics_to_host(m) for m in outputs]))

  def predict(self, state: TrainState, batch: Batch) -> np.ndarray:
    """Host predictions for one batch (ensemble means for ensemble strategies)."""
    step_fn = self._compile("predict", self.predict_step, state)
    return self.strategy.outputs_to_host(step_fn(state, self.strategy.put_batch(dict(batch))))
