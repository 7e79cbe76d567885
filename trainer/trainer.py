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
import logging
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
from trainer.optim import create_optimizer
from trainer.train_state import TrainState

Batch = Mapping[str, Any]
PyTree = Any

MASK_KEY = "mask"


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
  to `batch_size`), `log_every_steps`, `eval_every_steps`, `strategy.*`, and
  the optimizer fields read by `trainer.optim.create_optimizer`.

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
    self.model = self.build_model()
    self.optimizer = self.build_optimizer()
    self._compiled: dict[str, Callable] = {}
    #: (step, results) of every evaluation `fit` ran, oldest first.
    self.eval_history: list[tuple[int, dict[str, float]]] = []

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
    """One optimizer update on one batch: `(state, batch) -> (state, metrics)`."""
    rng = self.strategy.replica_rng(jax.random.fold_in(state.rng, state.step))

    def loss_fn(params):
      outputs = self.apply_model(params, batch, rngs={"dropout": rng}, train=True)
      per_example = self.loss(outputs, batch)
      return jnp.mean(per_example), (per_example, outputs)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, (per_example, outputs)), grads = grad_fn(state.params)
    grads = self.strategy.mean_over_data(grads)
    new_state = state.apply_gradients(grads=grads)
    metrics = self.train_metrics(outputs, batch, per_example)
    return new_state, self.strategy.merge_metrics_over_data(metrics)

  def eval_step(self, state: TrainState, batch: Batch) -> PyTree:
    """Metrics of one padded eval batch."""
    outputs = self.apply_model(state.params, batch, rngs=None, train=False)
    return self.strategy.merge_metrics_over_data(self.eval_metrics(outputs, batch))

  def predict_step(self, state: TrainState, batch: Batch) -> jax.Array:
    """Predictions, averaged over ensemble members where there are several."""
    outputs = self.apply_model(state.params, batch, rngs=None, train=False)
    return self.strategy.mean_over_members(self.prediction(outputs))

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

  def fit(self, train_batches: Iterable[Batch], *, num_steps: int,
          state: TrainState | None = None,
          eval_batches: Callable[[], Iterable[Batch]] | None = None,
          writer: metric_writers.MetricWriter | None = None) -> TrainState:
    """Trains until `state.step == num_steps`, logging and evaluating periodically.

    Args:
      train_batches: host batches (dicts of arrays with the global batch as
        leading axis); consumed one per step.
      num_steps: the step to stop at.
      state: the state to continue from; created from `config.seed` if None.
      eval_batches: returns a fresh iterable of eval batches for each evaluation;
        evaluations run every `eval_every_steps` and at the last step, and are
        appended to `self.eval_history`.
      writer: where scalars go; console logging if None.

    Returns:
      The final state.
    """
    writer = writer or metric_writers.LoggingWriter()
    batches: Iterator[Batch] = iter(train_batches)
    first = next(batches)
    if state is None:
      state = self.init_state(first)
    logging.info("Strategy: %s", self.strategy.describe())
    step_fn = self._compile("train", self.train_step, state)
    log_every = self.config.get("log_every_steps", 100)
    eval_every = self.config.get("eval_every_steps", 0)

    step = int(np.ravel(self.strategy.to_canonical(state.step))[0])  # Members step together.
    pending: list[PyTree] = []  # Step metrics stay on device until the next log.
    batch, tick = first, time.perf_counter()
    while step < num_steps:
      state, step_metrics = step_fn(state, self.strategy.put_batch(batch))
      pending.append(step_metrics)
      step += 1
      if step % log_every == 0 or step == num_steps:
        merged = metrics_lib.merge_all([self.strategy.metrics_to_host(m) for m in pending])
        scalars = {f"train/{k}": v for k, v in metrics_lib.scalars(merged).items()}
        scalars.update(self._progress(step, num_steps, len(pending), time.perf_counter() - tick))
        writer.write_scalars(step, scalars)
        pending, tick = [], time.perf_counter()
      if eval_batches is not None and (
          (eval_every and step % eval_every == 0) or step == num_steps):
        results = self.evaluate(state, eval_batches())
        self.eval_history.append((step, results))
        writer.write_scalars(step, {f"eval/{k}": v for k, v in results.items()})
        tick = time.perf_counter()
      if step < num_steps:
        batch = next(batches)
    writer.flush()
    return state

  def _progress(self, step: int, num_steps: int, steps: int, seconds: float) -> dict[str, float]:
    """Throughput scalars for a log interval, and a console line with the ETA."""
    steps_per_sec = steps / max(seconds, 1e-9)
    examples_per_sec = steps_per_sec * self.config.batch_size
    eta = (num_steps - step) / steps_per_sec
    logging.info("step %d/%d: %.2f steps/s, %.0f examples/s, ETA %dm%02ds", step, num_steps,
                 steps_per_sec, examples_per_sec, eta // 60, eta % 60)
    return {"train/steps_per_sec": steps_per_sec, "train/examples_per_sec": examples_per_sec}

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
