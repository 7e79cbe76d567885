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
import functools
import itertools
import logging
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from clu import metric_writers
from clu import metrics as clu_metrics

from strategies import Strategy, create_strategy
from strategies.base import BATCH_AXIS, bind_size_one_batch_axis, keypath_str
from trainer import actions as actions_lib
from trainer import metrics as metrics_lib
from trainer import model_variables
from trainer.accumulation import Accumulation
from trainer.actions import Action, FitResult, Loop
from trainer.checkpoint import Checkpointer, CheckpointError
from trainer.feed import DeviceFeed, is_checkpointable
from trainer.optim import create_optimizer, create_schedule
from trainer.precision import Precision
from trainer.train_state import EmaTrainState, TrainState

Batch = Mapping[str, Any]
PyTree = Any

MASK_KEY = "mask"

#: Folded into `state.rng` for the RNG streams of eval and predict (never a train step).
EVAL_RNG_TAG = 0x7FFFFFFF

#: What `config.nonfinite` may say a train step does with a non-finite loss or gradient.
NONFINITE_ACTIONS = ("stop", "skip")


class BatchKeyError(KeyError):
  """A hook read a batch entry that the batch does not have."""

  def __str__(self) -> str:  # KeyError would show the message quoted, as a key.
    return str(self.args[0])


def wait_for_previous_call(outputs: list) -> None:
  """Keeps one compiled call queued behind the running one: blocks on the call before the last.

  On XLA:CPU with several (fake) devices, many queued programs that contain
  collectives deadlock in the collective's rendezvous ("Expected 8 threads to
  join the rendezvous"): measured here, back-to-back train steps or eval calls
  under `sharded_data_parallel` hung within 2000 calls, while the same calls
  with one in flight ran 2000 train steps and 4000 eval calls. Waiting on the
  previous call costs no device time: the next one is already queued.
  """
  if len(outputs) > 1:
    jax.block_until_ready(outputs[-2])


def _batch_size(batch: Batch) -> int:
  """The leading dimension shared by a batch's arrays."""
  return int(np.shape(jax.tree.leaves(batch)[0])[0])


def _models(num_members: int) -> str:
  return f"{num_members} models" if num_members else "a single model"


def pad_batch(batch: Batch, size: int) -> dict[str, np.ndarray]:
  """Pads a host batch to `size` examples and adds a 0/1 `mask` of the real ones.

  Raises:
    ValueError: the batch is larger than `size`.
  """
  n = _batch_size(batch)
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

  Required hooks: `build_model` (a Linen module, or a factory of an NNX one)
  and `loss`. Optional hooks: `model_inputs` (what the model is called with),
  `apply_model`, `build_schedule`, `build_optimizer`, `create_train_state`,
  `train_metrics`, `eval_metrics`, `prediction`, `default_actions` (the
  loop's side effects, `trainer.actions`).

  Model variables: `state.params` and `state.model_state` (every other
  collection, e.g. BatchNorm's `batch_stats`: updated by the train step, read
  by eval and predict, checkpointed). `trainer.model_variables` is the one
  place that knows Linen from NNX.

  Modes and randomness: the train step calls the model in training mode, eval
  and predict in eval mode (see `trainer.model_variables` for how the mode
  reaches the module). Each stream in `rng_streams` gets its own key, derived
  from `fold_in(state.rng, step)`; `pmap_data_parallel` and `sharded_ensemble`
  with several data replicas fold in the replica index (`Strategy.replica_rng`),
  so their dropout masks are independent draws rather than the single-device
  mask; `sharded_data_parallel` draws the single-device masks exactly. Ensemble
  members draw from their own `state.rng`, so their streams differ.

  Config fields read here: `seed`, `batch_size`, `eval_batch_size` (defaults
  to `batch_size`), `num_train_steps`, `nonfinite`, `ema_decay`,
  `strategy.*`; `grad_accum_*` by `trainer.accumulation`,
  `mixed_precision.*` by `trainer.precision`, the
  optimizer and schedule fields by `trainer.optim`, and `log_every_steps`,
  `eval_every_steps`, `early_stopping.*`, `profile.*` by `trainer.actions`.

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
    """Builds strategy, model and optimizer, validating the config before any compute.

    Args:
      config: the run's config.
      strategy: overrides the one `config.strategy` names.
      num_train_steps: the run's length, which decaying learning-rate schedules
        need; defaults to `config.num_train_steps` when that is positive.

    Raises:
      ValueError: an unknown strategy or optimizer, a mesh or rule table that
        does not fit the devices, a batch size that does not split evenly (into
        data replicas and `grad_accum_steps` microbatches), or a recipe field
        out of range.
    """
    self.config = config
    self.strategy = strategy if strategy is not None else create_strategy(config)
    self.strategy.check_processes()
    self.strategy.check_batch_size(config.batch_size)
    if num_train_steps is None and config.get("num_train_steps", 0) > 0:
      num_train_steps = config.num_train_steps
    self.num_train_steps = num_train_steps
    self.accumulation = Accumulation.from_config(
        config, num_data_replicas=self.strategy.num_data_replicas,
        strategy_name=self.strategy.name)
    self.ema_decay = config.get("ema_decay", 0.0) or 0.0
    if not 0.0 <= self.ema_decay < 1.0:
      raise ValueError(f"config.ema_decay={self.ema_decay!r} must be in [0, 1) "
                       f"(0: no EMA of the parameters).")
    self.precision = Precision.from_config(config)
    self.eval_batch_size = config.get("eval_batch_size", config.batch_size)
    if not isinstance(self.eval_batch_size, int) or self.eval_batch_size < 1:
      raise ValueError(f"config.eval_batch_size={self.eval_batch_size!r} must be a positive "
                       f"integer (any size: eval batches are padded to split evenly).")
    # Eval and predict run on chunks of `eval_batch_size` examples, padded (and
    # masked) up to the next multiple of the data replicas: one compiled shape.
    replicas = self.strategy.num_data_replicas
    self._padded_eval_size = -(-self.eval_batch_size // replicas) * replicas
    self.prefetch = config.get("prefetch_to_device", 1)
    if not isinstance(self.prefetch, int) or self.prefetch < 0:
      raise ValueError(f"config.prefetch_to_device={self.prefetch!r} must be an integer >= 0: "
                       f"how many train batches are put on the devices ahead of their step.")
    self.nonfinite = config.get("nonfinite", "stop")
    if self.nonfinite not in NONFINITE_ACTIONS:
      raise ValueError(f"config.nonfinite={self.nonfinite!r} is not one of "
                       f"{NONFINITE_ACTIONS}: 'stop' raises at the first non-finite loss or "
                       f"gradient norm, 'skip' leaves such updates out and counts them.")
    self.schedule = self.build_schedule()
    self.model = self.build_model()
    self.model_variables = model_variables.create(self.model,
                                                  sync_batchnorm=config.sync_batchnorm)
    self.optimizer = self.build_optimizer()
    self._compiled: dict[str, Callable] = {}  # Step name -> the strategy's compiled step.
    self._traced: set[str] = set()  # Eval-side steps traced ahead of their first use.

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

  def build_schedule(self) -> optax.Schedule | None:
    """`step -> learning rate`, logged as `train/learning_rate`; from `config.schedule`.

    Return None if `build_optimizer` makes its own learning rates.
    """
    return create_schedule(self.config, self.num_train_steps)

  def build_optimizer(self) -> optax.GradientTransformation:
    """The optax optimizer; by default `trainer.optim.create_optimizer` with `self.schedule`.

    The default clips by `grad_clip_norm` and decays the weights that
    `trainer.optim.default_decay_mask` selects (not biases or norm scales).
    """
    return create_optimizer(self.config, self.schedule)

  def learning_rate(self, step: int) -> float | None:
    """The learning rate of the update from `step` to `step + 1`, or None if unknown."""
    return None if self.schedule is None else float(self.schedule(step))

  def default_actions(self, *, checkpointer: Checkpointer | None,
                      eval_batches: Callable[[], Iterable[Batch]] | None,
                      workdir: str | None) -> list[Action]:
    """The loop's built-in actions, in the order that states its rules (see `trainer.actions`).

    Override to reorder or replace them; `fit(actions=...)` adds to them.
    """
    return actions_lib.default_actions(self, checkpointer=checkpointer,
                                       eval_batches=eval_batches, workdir=workdir)

  def model_inputs(self, batch: Batch, *, train: bool,
                   rngs: Mapping[str, jax.Array]) -> tuple[tuple, dict]:
    """`(args, kwargs)` the model is called with on `batch`: `(batch[input_key],), {}`.

    Override for several inputs (`(batch['inputs'], batch['targets']), {}`) or
    an RNG argument (`rngs['z']`, with 'z' in `rng_streams`). The mode
    arguments the module declares (`train`, `deterministic`) are added unless
    given here.
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
        loss=self._per_example_loss(outputs, batch), mask=batch[MASK_KEY])

  def prediction(self, outputs: Any) -> jax.Array:
    """What an ensemble averages over members: class probabilities by default."""
    return jax.nn.softmax(outputs, axis=-1)

  # -- Pure step functions (single-replica terms; compiled by the strategy) --

  def _per_example_loss(self, outputs: Any, batch: Batch) -> jax.Array:
    """`self.loss`, checked (while tracing) to give one loss per example."""
    loss = self.loss(outputs, batch)
    n = _batch_size(batch)
    if jnp.ndim(loss) != 1 or jnp.shape(loss)[0] != n:
      raise ValueError(
          f"{type(self).__name__}.loss returned shape {tuple(jnp.shape(loss))} for a batch of "
          f"{n} examples (the part one data replica sees); it must return one loss per "
          f"example, shape ({n},). The Trainer takes the mean itself, over data replicas "
          f"too: return the per-example values (e.g. a per-token loss averaged over "
          f"tokens only), not their mean.")
    return loss

  def _explaining_missing_keys(self, fn: Callable) -> Callable:
    """`fn(state_or_rng, batch)`, where reading an entry the batch lacks names those it has,
    and a missing RNG stream or an unbound axis name says what to change."""

    @functools.wraps(fn)
    def wrapped(first, batch):
      try:
        return fn(first, batch)
      except flax.errors.InvalidRngError as e:
        raise ValueError(
            f"{e}. {type(self).__name__}.rng_streams={self.rng_streams!r}: add the stream "
            f"the model asks for to rng_streams.") from e
      except NameError as e:
        unbound = re.search(r"unbound axis name: (\w+)", str(e))
        if not unbound or unbound.group(1) == BATCH_AXIS:
          raise
        raise ValueError(
            f"{e}: inside a step the data axis is named strategies.BATCH_AXIS="
            f"{BATCH_AXIS!r} under every strategy; use that name (e.g. "
            f"BatchNorm(axis_name={BATCH_AXIS!r})).") from e
      except KeyError as e:
        key = e.args[0] if e.args else None
        if isinstance(e, BatchKeyError) or not isinstance(batch, Mapping) or key in batch:
          raise
        raise BatchKeyError(
            f"the batch has no entry {key!r}; its entries are {sorted(batch)}. "
            f"{type(self).__name__} reads input_key={self.input_key!r} and target_key="
            f"{self.target_key!r}: set them on the Trainer subclass to the batch's names, "
            f"or override the hook that reads {key!r}.") from e

    return wrapped

  def init_fn(self, example_batch: Batch) -> Callable[[jax.Array], TrainState]:
    """`rng -> TrainState` for a model fed batches shaped like `example_batch`."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                          dict(example_batch))

    def init(rng: jax.Array, zeros: Batch) -> TrainState:
      params_rng, state_rng = jax.random.split(rng)
      rngs = model_variables.RngStreams(params=params_rng, **self.step_rngs(params_rng))
      inputs = self.model_inputs(zeros, train=False, rngs=rngs)
      # Bound (size 1) so a model that names the batch axis also inits outside a step.
      params, model_state = bind_size_one_batch_axis(
          lambda inputs: self.model_variables.init(rngs, inputs), inputs)
      return self.create_train_state(params=params, model_state=model_state, rng=state_rng)

    init = self._explaining_missing_keys(init)
    return lambda rng: init(rng, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))

  def create_train_state(self, *, params: PyTree, model_state: PyTree,
                         rng: jax.Array) -> TrainState:
    """The initial state of one model: an `EmaTrainState` when `config.ema_decay` > 0."""
    fields = dict(apply_fn=self.model_variables.apply, params=params, model_state=model_state,
                  tx=self.optimizer, rng=rng)
    if self.ema_decay:
      return EmaTrainState.create(ema_decay=self.ema_decay, **fields)
    return TrainState.create(**fields)

  def train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, PyTree]:
    """One optimizer update: `(state, batch) -> (state, {'metrics', 'finite'})`.

    With `grad_accum_steps = k > 1` the batch runs as k microbatches
    (`trainer.accumulation`): the update is the big-batch update, and the
    model state (BatchNorm statistics) is carried from microbatch to
    microbatch. `finite` says whether the mean loss and the
    gradient norm were finite; with `nonfinite='skip'` a non-finite step keeps
    the old parameters and optimizer state (the step counter still advances,
    so data stays aligned).
    """
    key = self.strategy.replica_rng(jax.random.fold_in(state.rng, state.step))
    grads, mean_loss, model_state, metrics = self.accumulation.gradients(
        self._gradients, state.params, state.model_state, batch, key,
        constrain=self.strategy.constrain_batch)
    grads = self.strategy.mean_over_data(grads)
    finite = (jnp.isfinite(self.strategy.mean_over_data(mean_loss))
              & jnp.isfinite(optax.tree.norm(grads)))
    new_state = state.apply_gradients(grads=grads).replace(model_state=model_state)
    if self.nonfinite == "skip":
      kept = state.replace(step=new_state.step)
      new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, kept)
    return new_state, {"metrics": self.strategy.merge_metrics_over_data(metrics),
                       "finite": finite}

  def _gradients(self, params: PyTree, model_state: PyTree, batch: Batch,
                 key: jax.Array) -> tuple[PyTree, jax.Array, PyTree, PyTree]:
    """`(gradients, mean loss, new model_state, metrics)` of one (micro)batch, before any
    mean over data replicas. The loss is scaled by `precision.loss_scale` for the
    backward pass (float16) and the gradients unscaled."""
    rngs = self.step_rngs(key)
    scale = self.precision.loss_scale

    def loss_fn(params):
      outputs, new_model_state = self._forward(params, model_state, batch, rngs=rngs,
                                               train=True)
      per_example = self._per_example_loss(outputs, batch)
      mean = jnp.mean(per_example)
      return mean * scale, (mean, per_example, outputs, new_model_state)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, (mean_loss, per_example, outputs, new_model_state)), grads = grad_fn(params)
    if scale != 1.0:
      grads = jax.tree.map(lambda g: g / scale, grads)
    return grads, mean_loss, new_model_state, self.train_metrics(outputs, batch, per_example)

  def _forward(self, params: PyTree, model_state: PyTree, batch: Batch, *,
               rngs: Mapping[str, jax.Array], train: bool) -> tuple[Any, PyTree]:
    """`apply_model` under the precision policy: compute dtype in, float32 outputs out.

    The model state keeps its dtypes (float32 BatchNorm statistics).
    """
    p = self.precision
    outputs, new_model_state = self.apply_model(p.to_compute(params), model_state,
                                                 p.to_compute(batch), rngs=rngs, train=train)
    if p.is_mixed:
      new_model_state = jax.tree.map(lambda new, old: jnp.asarray(new, old.dtype),
                                     new_model_state, model_state)
    return p.to_float32(outputs), new_model_state

  def _eval_outputs(self, state: TrainState, batch: Batch) -> Any:
    """The model's outputs in eval mode, with RNG streams of their own (fixed per state)."""
    rngs = self.step_rngs(self.strategy.replica_rng(jax.random.fold_in(state.rng, EVAL_RNG_TAG)))
    outputs, _ = self._forward(state.params, state.model_state, batch, rngs=rngs, train=False)
    return outputs

  def eval_step(self, state: TrainState, batch: Batch) -> PyTree:
    """Metrics of one padded eval batch."""
    outputs = self._eval_outputs(state, batch)
    return self.strategy.merge_metrics_over_data(self.eval_metrics(outputs, batch))

  def predict_step(self, state: TrainState, batch: Batch) -> jax.Array:
    """Predictions, averaged over ensemble members where there are several."""
    outputs = self._eval_outputs(state, batch)
    return self.strategy.mean_over_members(self.strategy.whole_batch(self.prediction(outputs)))

  # -- Running -----------------------------------------------------------------

  def init_state(self, example_batch: Batch, rng: jax.Array | None = None) -> TrainState:
    """Creates the placed train state; `rng` defaults to `PRNGKey(config.seed)`."""
    if rng is None:
      rng = jax.random.PRNGKey(self.config.seed)
    return self.strategy.create_state(self.init_fn(example_batch), rng)

  def _compiled_step(self, name: str, state: TrainState) -> Callable:
    """The strategy's compiled `{name}_step` ('train', 'eval' or 'predict'), made once."""
    if name not in self._compiled:
      fn = self._explaining_missing_keys(getattr(self, f"{name}_step"))
      compile_fn = (self.strategy.compile_train_step if name == "train"
                    else self.strategy.compile_eval_step)
      self._compiled[name] = compile_fn(fn, state)
    return self._compiled[name]

  def compiled_train_step(self, state: TrainState) -> Callable:
    """The compiled `(state, placed batch) -> (state, outputs)` that `fit` calls each step."""
    return self._compiled_step("train", state)

  def _trace_eval_steps(self, state: TrainState, train_batch: Batch,
                        eval_batches: Callable[[], Iterable[Batch]] | None) -> None:
    """Traces the eval and predict steps once, so their errors show before training.

    The example is the first eval batch if there are eval batches, else the
    first train batch; it is read only while a step is still untraced.
    """
    untraced = [name for name in ("eval", "predict") if name not in self._traced]
    if not untraced:
      return
    example = next(iter(eval_batches()), None) if eval_batches is not None else None
    if example is None:  # This process's rows of a train batch: the global shapes suffice.
      count = self.strategy.process_rows()[1]
      example = jax.tree.map(lambda x: np.concatenate([np.asarray(x)] * count), train_batch)
    chunk = self._put_eval_chunk(next(self._eval_chunks(example))[0])
    for name in untraced:
      self._compiled_step(name, state).lower(state, chunk)  # jit keeps the trace.
      self._traced.add(name)

  def _put_eval_chunk(self, chunk: Batch) -> PyTree:
    """A padded global eval chunk on devices, each process putting its own rows."""
    return self.strategy.put_batch(self.strategy.local_rows(chunk))

  def _eval_chunks(self, batch: Batch) -> Iterator[tuple[dict[str, np.ndarray], int]]:
    """`(padded chunk, real examples)` for `eval_batch_size` slices of a host batch."""
    n = _batch_size(batch)
    for start in range(0, n, self.eval_batch_size):
      part = {k: np.asarray(v)[start:start + self.eval_batch_size] for k, v in batch.items()}
      yield pad_batch(part, self._padded_eval_size), min(self.eval_batch_size, n - start)

  def _check_train_batch(self, batch: Batch, step: int) -> None:
    """Raises unless every array of the batch for `step` holds this process's rows of a
    `config.batch_size` batch (all of them on one process)."""
    rows = self.strategy.process_slice(self.config.batch_size)
    want = rows.stop - rows.start
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
      if not np.ndim(x) or np.shape(x)[0] != want:
        got = f"{np.shape(x)[0]} examples" if np.ndim(x) else "a scalar"
        if want != self.config.batch_size:
          raise ValueError(
              f"the train batch for step {step} holds {got} in {keypath_str(path)!r} (shape "
              f"{np.shape(x)}), but process {jax.process_index()} of {jax.process_count()} "
              f"feeds rows {rows.start}:{rows.stop} of each config.batch_size="
              f"{self.config.batch_size} batch, {want} examples; give each process its "
              f"rows (trainer.strategy.process_slice(batch_size)), not the whole batch.")
        raise ValueError(
            f"the train batch for step {step} holds {got} in {keypath_str(path)!r} (shape "
            f"{np.shape(x)}) but config.batch_size={want}; every train batch must hold "
            f"exactly batch_size examples (the step is compiled for that shape). Drop the "
            f"short last batch of an epoch (tf.data: drop_remainder=True) or pad it.")

  def step_of(self, state: TrainState) -> int:
    """The host value of the state's step (all members step together)."""
    return int(np.ravel(self.strategy.to_canonical(state.step))[0])

  def fit(self, train_batches: Callable[[int], Iterable[Batch]] | Iterable[Batch], *,
          num_steps: int, state: TrainState | None = None,
          eval_batches: Callable[[], Iterable[Batch]] | None = None,
          writer: metric_writers.MetricWriter | None = None,
          checkpointer: Checkpointer | None = None, actions: Iterable[Action] = (),
          workdir: str | None = None) -> FitResult:
    """Trains until `state.step == num_steps` (or an action stops it), running the actions.

    The loop itself only steps; logging, the non-finite guard, evaluation,
    early stopping, checkpoints, SIGTERM and profiling are actions
    (`trainer.actions`), run after each step in the order `default_actions`
    gives, with `actions` inserted before the checkpoint (so a checkpoint
    holds their state after this step). With a `checkpointer`, a run whose directory
    holds a complete checkpoint resumes from the latest one (no flag needed),
    the actions' saved state included.

    Args:
      train_batches: `start_step -> iterable of host batches`, where batch i is
        the batch for step `start_step + i` (needed to resume), or an iterable
        consumed one batch per step from the state's current step. Each batch
        holds this process's rows (`strategy.process_slice(batch_size)`: all
        of them on one process). An iterator with `get_state`/`set_state`
        (Grain's) has its position saved with each checkpoint and restored
        on resume.
      num_steps: the step to stop at.
      state: the state to continue from; else restored from `checkpointer`,
        else created from `config.seed`.
      eval_batches: returns a fresh iterable of eval batches for each evaluation
        (every `eval_every_steps` and at the last step).
      writer: where scalars go; console logging if None.
      checkpointer: where checkpoints are saved and resumed from.
      actions: the user's actions: after the guard, logging and evaluation,
        before the checkpoint.
      workdir: where a profile trace goes (`config.profile`).

    Returns:
      A `FitResult`: the final state, the evaluations, why the run stopped.

    Raises:
      ValueError: a train batch does not hold `config.batch_size` examples
        (raised before that step runs), or a hook's output has the wrong shape
        (raised while the steps are traced, before training).
      BatchKeyError: a hook reads a batch entry the batch does not have.
      NonFiniteError: a step's loss or gradient norm was not finite under
        `nonfinite='stop'`; no checkpoint of a non-finite state is written.
      CheckpointError: a checkpoint could not be read, restored or written.
    """
    self._check_schedule_length(num_steps)
    writer = writer or metric_writers.LoggingWriter()
    run_actions = actions_lib.with_user_actions(
        self.default_actions(checkpointer=checkpointer, eval_batches=eval_batches,
                             workdir=workdir), list(actions))
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
    checkpointable = is_checkpointable(batches)
    if resume_step and checkpointable:
      data_state = checkpointer.data_state(resume_step)
      if data_state is not None:  # Else the iterator's own start (a checkpoint without one).
        batches.set_state(data_state)
    batch = next(batches)
    self._check_train_batch(batch, start)
    feed = DeviceFeed(itertools.chain([batch], batches), start, check=self._check_train_batch,
                      put=self.strategy.put_batch, ahead=self.prefetch, stop_step=num_steps,
                      state_of=batches.get_state if checkpointable else None)
    if state is None:
      state = (self.restore_checkpoint(checkpointer, batch, step=resume_step)
               if resume_step else self.init_state(batch))
    if resume_step:
      logging.info("Resuming at step %d from %s", resume_step, checkpointer.step_dir(resume_step))
      saved = checkpointer.action_states(resume_step)
      for action in run_actions:
        if action.name in saved:
          action.load_state_dict(saved[action.name])
    if logging.getLogger().isEnabledFor(logging.INFO):  # The summary reads every shard.
      logging.info("Strategy %s", self.strategy.summary(state))
    step_fn = self.compiled_train_step(state)
    # Eval and predict are traced now, so that a mistake in them stops the run
    # before it trains rather than at the first evaluation.
    self._trace_eval_steps(state, batch, eval_batches)

    loop = Loop(trainer=self, state=state, step=start, num_steps=num_steps, start_step=start,
                actions=run_actions, writer=writer, checkpointer=checkpointer)
    loop.result = FitResult(state=state, step=start)
    with self._waiting_for_saves(checkpointer), loop.running():
      while loop.step < num_steps and loop.stop_reason is None:
        placed, loop.data_state = feed.next()
        loop.state, loop.outputs = step_fn(loop.state, placed)
        loop.step += 1
        feed.fill()  # The next batches are read and placed while this step runs.
        loop.run_step_actions()
    writer.flush()
    loop.result.state, loop.result.step = loop.state, loop.step
    loop.result.stopped_by = loop.stop_reason
    return loop.result

  def _check_schedule_length(self, num_steps: int) -> None:
    """Compares the run's length with the one the config's decaying schedule was built for.

    Longer raises (the rate would sit at its floor for the extra steps); shorter
    warns, since stopping part-way and resuming later is a normal use.
    """
    name, length = self.config.schedule.name, self.num_train_steps
    if (type(self).build_schedule is not Trainer.build_schedule or name == "constant"
        or num_steps == length):
      return
    fix = (f"build the Trainer with num_train_steps={num_steps} (or set "
           f"config.num_train_steps={num_steps})")
    if num_steps > length:
      raise ValueError(
          f"fit(num_steps={num_steps}) runs past the end of config.schedule.name={name!r}, "
          f"which decays over num_train_steps={length} steps: the last "
          f"{num_steps - length} steps would train at the final rate; {fix}.")
    logging.warning("fit(num_steps=%d) stops before config.schedule.name=%r has decayed: it "
                    "is built for num_train_steps=%d steps, so the run ends at a rate above "
                    "its end. If the run is not meant to resume later, %s.",
                    num_steps, name, length, fix)

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

  # -- Checkpoints -------------------------------------------------------------

  def checkpoint_layout(self) -> dict[str, Any]:
    """What a checkpoint records about its layout besides the arrays."""
    return {"num_members": self.strategy.num_members if self.strategy.is_ensemble else 0,
            "strategy": self.strategy.name}

  def save_checkpoint(self, checkpointer: Checkpointer, state: TrainState, step: int, *,
                      metrics: Mapping[str, float] | None = None,
                      action_states: Mapping[str, Any] | None = None,
                      data_state: Any = None) -> None:
    """Starts an asynchronous save of `state` as checkpoint `step`.

    Args:
      metrics: eval results at `step`, which orbax ranks best checkpoints by.
      action_states: the loop's actions' JSON state, restored on resume.
      data_state: the train data iterator's position after step `step - 1`'s batch.
    """
    checkpointer.save(step, self.strategy.checkpoint_state(state), self.checkpoint_layout(),
                      metrics=metrics, action_states=action_states, data_state=data_state)

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

  def compiled_train_step_text(self, state: TrainState, example_batch: Batch) -> str:
    """The optimised HLO of the train step as the strategy compiles it (collectives included)."""
    step_fn = self.compiled_train_step(state)
    return step_fn.lower(state, self.strategy.put_batch(example_batch)).compile().as_text()

  def evaluate(self, state: TrainState, batches: Iterable[Batch]) -> dict[str, float]:
    """Eval metrics over all `batches`, of any size.

    Each batch is cut into `eval_batch_size` chunks, each padded to a size the
    strategy can split, with the padding masked out of the metrics.

    Raises:
      ValueError: `batches` is empty.
    """
    step_fn = self._compiled_step("eval", state)
    outputs = []
    for batch in batches:
      for chunk, _ in self._eval_chunks(batch):
        outputs.append(step_fn(state, self._put_eval_chunk(chunk)))
        wait_for_previous_call(outputs)
    if not outputs:
      raise ValueError("evaluate() got no eval batches (an empty iterable).")
    return metrics_lib.scalars(self.strategy.metrics_to_host(outputs))

  def predict(self, state: TrainState, batch: Batch) -> np.ndarray:
    """Host predictions for a batch of any size (ensemble means for ensembles).

    The batch runs in padded `eval_batch_size` chunks, like evaluation.
    """
    step_fn = self._compiled_step("predict", state)
    outputs, sizes = [], []
    for chunk, real in self._eval_chunks(dict(batch)):
      outputs.append(step_fn(state, self._put_eval_chunk(chunk)))
      sizes.append(real)
      wait_for_previous_call(outputs)
    parts = [jax.tree.map(lambda x, n=real: x[:n], self.strategy.outputs_to_host(out))
             for out, real in zip(outputs, sizes, strict=True)]
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)
