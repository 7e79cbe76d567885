"""The pure step functions (init, train, eval, predict), built once from the Trainer's parts.

They are written in single-replica terms: the strategy compiles them (pmap,
or jit over a mesh) and provides the collectives they call, which are
identities on a single device. The train step is the recipe's four stages
(`trainer.step.recipe`): forward, loss, gradients, update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from strategies import Ensemble, Strategy
from strategies.mesh import bind_size_one_batch_axis
from trainer import metrics as metrics_lib
from trainer.step.errors import explaining_errors
from trainer.step.host_calls import HostCalls
from trainer.step.recipe import Recipe
from trainer.step.rng_streams import RngStreams
from trainer.step.stages import Batch, GradFn, LossFn, StepAux, differentiated, zero_gradient

PyTree = Any

#: Folded into `state.rng` for the RNG streams of eval and predict (never a train step).
EVAL_RNG_TAG = 0x7FFFFFFF


def batch_size_of(batch: Batch) -> int:
  """The leading dimension shared by a batch's arrays."""
  return int(np.shape(jax.tree.leaves(batch)[0])[0])


def _value_and_grad(loss_fn: LossFn) -> GradFn:
  """The loss's gradient for the parameters' inexact leaves; integer leaves (a quantized
  base's codes, `trainer.step.quantized_base`) are constants of the loss and get zeros."""
  grad = jax.value_and_grad(loss_fn, has_aux=True)

  def grad_fn(params, model_state, batch, key):
    leaves, treedef = jax.tree.flatten(params)
    inexact = [differentiated(x) for x in leaves]
    if all(inexact):
      (_, aux), grads = grad(params, model_state, batch, key)
      return grads, aux

    def of_inexact(values, *rest):
      it = iter(values)
      whole = [next(it) if f else x for x, f in zip(leaves, inexact, strict=True)]
      return loss_fn(treedef.unflatten(whole), *rest)

    (_, aux), some = jax.value_and_grad(of_inexact, has_aux=True)(
        [x for x, f in zip(leaves, inexact, strict=True) if f], model_state, batch, key)
    it = iter(some)
    return treedef.unflatten([next(it) if f else zero_gradient(x)
                              for x, f in zip(leaves, inexact, strict=True)]), aux

  return grad_fn


def _apply_update(state, grads, aux: StepAux, finite):
  del finite
  return state.apply_gradients(grads=grads).replace(model_state=aux.model_state)


class StepFunctions:
  """`init_fn`, `train`, `eval` and `predict` of one Trainer.

  Args:
    hooks: the Trainer, whose hooks (`apply_model`, `loss`, metrics,
      `prediction`, `model_inputs`, `step_rngs`, `create_train_state`) the
      steps call while they are traced.
    strategy: the collectives the steps call.
    init_model: `(rngs, inputs) -> (params, model_state)` of a new model.
    recipe: the transforms the train step is built from.
  """

  def __init__(self, hooks: Any, strategy: Strategy,
               init_model: Callable[[Any, Any], tuple[PyTree, PyTree]], recipe: Recipe):
    self.hooks, self.strategy, self.recipe = hooks, strategy, recipe
    self._init_model = init_model
    # The strategy may hold sequences in another order (`Strategy.in_sequence_layout`).
    self.forward = recipe.forward(strategy.in_sequence_layout(
        lambda params, model_state, batch, rngs, train: hooks.apply_model(
            params, model_state, batch, rngs=rngs, train=train)))
    self._gradients = recipe.gradients(_value_and_grad(recipe.loss(self._loss)), strategy)
    self._update = recipe.update(_apply_update)
    self._init_fns: dict[Any, Callable[[jax.Array], Any]] = {}

  # -- Init --------------------------------------------------------------------------

  def init_fn(self, example_batch: Batch) -> Callable[[jax.Array], Any]:
    """`rng -> train state` for a model fed batches shaped like `example_batch`: the same
    function for the same shapes, so a strategy compiles it once (`create_state`)."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                          dict(example_batch))
    leaves, treedef = jax.tree.flatten(shapes)
    key = (treedef, tuple((x.shape, x.dtype) for x in leaves))
    if key not in self._init_fns:
      self._init_fns[key] = self._make_init_fn(shapes)
    return self._init_fns[key]

  def _make_init_fn(self, shapes: Batch) -> Callable[[jax.Array], Any]:
    hooks = self.hooks

    def init(rng: jax.Array, zeros: Batch):
      params_rng, state_rng = jax.random.split(rng)
      rngs = RngStreams(params=params_rng, **hooks.step_rngs(params_rng))
      inputs = hooks.model_inputs(zeros, train=False, rngs=rngs)
      # Bound (size 1) so a model that names the batch axis also inits outside a step.
      params, model_state = bind_size_one_batch_axis(
          lambda inputs: self._init_model(rngs, inputs), inputs)
      state = hooks.create_train_state(params=params, model_state=model_state, rng=state_rng)
      return self.recipe.init_state(state)

    init = explaining_errors(init, hooks)
    return lambda rng: init(rng, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))

  # -- Train ---------------------------------------------------------------------------

  def per_example_loss(self, outputs: Any, batch: Batch) -> jax.Array:
    """The `loss` hook, checked (while tracing) to give one loss per example."""
    loss = self.hooks.loss(outputs, batch)
    n = batch_size_of(batch)
    if jnp.ndim(loss) != 1 or jnp.shape(loss)[0] != n:
      raise ValueError(
          f"{type(self.hooks).__name__}.loss returned shape {tuple(jnp.shape(loss))} for a "
          f"batch of {n} examples (the part one data replica sees); it must return one loss "
          f"per example, shape ({n},). The Trainer takes the mean itself, over data replicas "
          f"too: return the per-example values (e.g. a per-token loss averaged over tokens "
          f"only), not their mean.")
    return loss

  def _loss(self, params, model_state, batch, key) -> tuple[jax.Array, StepAux]:
    outputs, new_model_state = self.forward(params, model_state, batch,
                                            self.hooks.step_rngs(key), True)
    per_example = self.per_example_loss(outputs, batch)
    mean = jnp.mean(per_example)
    return mean, StepAux(mean, new_model_state,
                         self.hooks.train_metrics(outputs, batch, per_example))

  def train(self, state, batch: Batch) -> tuple[Any, PyTree]:
    """One optimizer update: `(state, batch) -> (state, {'metrics', 'finite'})`.

    `metrics` are the `train_metrics` hook's and `grad_norm`; `finite` says whether the mean
    loss and the gradient norm were finite.
    """
    s = self.strategy
    key = s.replica_rng(jax.random.fold_in(state.rng, state.step))
    grads, aux = self._gradients(state.params, state.model_state, batch, key)
    grads = s.mean_over_data(grads)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(s.mean_over_data(aux.loss)) & jnp.isfinite(grad_norm)
    # The gradient's global norm before any clipping, as `grad_norm` (Hugging Face's name).
    metrics = metrics_lib.with_average(aux.metrics, "grad_norm", grad_norm)
    return self._update(state, grads, aux, finite), {
        "metrics": s.merge_metrics_over_data(metrics), "finite": finite}

  # -- Eval and predict ------------------------------------------------------------------

  def eval_outputs(self, state, batch: Batch) -> Any:
    """The model's outputs in eval mode, with RNG streams of their own (fixed per state)."""
    key = self.strategy.replica_rng(jax.random.fold_in(state.rng, EVAL_RNG_TAG))
    outputs, _ = self.forward(state.params, state.model_state, batch,
                              self.hooks.step_rngs(key), False)
    return outputs

  def eval(self, state, batch: Batch) -> PyTree:
    """Metrics of one padded eval batch."""
    outputs = self.eval_outputs(state, batch)
    return self.strategy.merge_metrics_over_data(self.hooks.eval_metrics(outputs, batch))

  def predict(self, state, batch: Batch) -> jax.Array:
    """Predictions, averaged over ensemble members where there are several."""
    outputs = self.eval_outputs(state, batch)
    predictions = self.strategy.whole_batch(self.hooks.prediction(outputs))
    if isinstance(self.strategy, Ensemble):
      predictions = self.strategy.mean_over_members(predictions)
    return predictions


#: How a call's steps run: a `lax.scan` loop, or unrolled into straight-line code.
STEP_LOOPS = ("scan", "unroll")


def default_steps_loop(platform: str) -> str:
  """`unroll` on XLA:CPU, where a CNN step inside a loop runs about 12x slower and
  the unrolled steps give the bits of one step a call (`benchmarks/steps_per_call.py`);
  `scan` elsewhere, where one loop body compiles once for any number of steps."""
  return "unroll" if platform == "cpu" else "scan"


def check_steps_loop(loop: str) -> None:
  """Raises unless `config.steps_loop` is one of `STEP_LOOPS`, or '' (the platform's default).

  Raises:
    ValueError: naming the value and the loops.
  """
  if loop and loop not in STEP_LOOPS:
    raise ValueError(f"config.steps_loop={loop!r} is not one of {STEP_LOOPS} (or '' for the "
                     f"platform's default).")


def several_steps(train_step: Callable, strategy: Strategy, *, data: Any = None,
               num_steps: int | None = None, loop: str = "scan") -> Callable:
  """`(state, batches, data inputs) -> (state, outputs)`: `train_step` over several steps.

  With host batches (`data` None) the steps are the leading axis of
  `batches`. With a device-resident dataset (`trainer.data.DeviceData`) each
  step gathers its own batch, `data.batch_at(inputs, state.step)`, for
  `num_steps` steps. Each output gains a leading step axis. `loop` is one
  of `STEP_LOOPS`.
  """
  if data is None:
    def step_at(state, batches, inputs, i):
      del inputs
      return train_step(state, jax.tree.map(lambda x: x[i], batches))
  else:
    def step_at(state, batches, inputs, i):
      del batches, i
      return train_step(state, data.batch_at(inputs, state.step, strategy))

  def chunk(state, batches, inputs):
    count = num_steps if data is not None else np.shape(jax.tree.leaves(batches)[0])[0]
    if loop == "unroll":  # Python-unrolled: `lax.scan(unroll=True)` keeps a loop for 1 step.
      outputs = []
      for i in range(count):
        state, out = step_at(state, batches, inputs, i)
        outputs.append(out)
      return state, jax.tree.map(lambda *xs: jnp.stack(xs), *outputs)
    return jax.lax.scan(lambda state, i: step_at(state, batches, inputs, i), state,
                        jnp.arange(count))

  return chunk


class CompiledSteps:
  """The strategy's compiled train, eval and predict steps, each compiled once on first use.

  Each compiles the hooks' `train_step` / `eval_step` / `predict_step`, so a
  Trainer subclass that overrides one is compiled with its override.
  `steps_loop` (`config.steps_loop`) is how a call of several steps runs them:
  one of `STEP_LOOPS`, or '' for the platform's default (`default_steps_loop`).
  `host_calls` holds the host functions the programs call (`jax.pure_callback`) and their
  first error, which the run and the evaluator raise once a call is done
  (`trainer.step.host_calls`).
  """

  def __init__(self, hooks: Any, strategy: Strategy, *, steps_loop: str = ""):
    check_steps_loop(steps_loop)
    self._hooks, self._strategy = hooks, strategy
    self.host_calls = HostCalls()
    self._steps_loop = steps_loop or default_steps_loop(jax.devices()[0].platform)
    self._train = self._eval = self._predict = None
    self._chunks: dict[Any, Callable] = {}

  def train(self, state) -> Callable:
    """The compiled `(state, placed batch) -> (state, outputs)`, donating the state.

    `state` is a placed state whose layout the compiled step keeps.
    """
    if self._train is None:
      self._train = self._strategy.compile_train_step(
          explaining_errors(self._hooks.train_step, self._hooks), state)
    return self._train

  def train_text(self, state, example_batch: Batch) -> str:
    """The optimised HLO of the compiled train step (collectives included), for batches
    shaped like the host batch `example_batch`."""
    return self.train(state).lower(state, self._strategy.put_batch(example_batch)).compile(
        ).as_text()

  def train_chunk(self, state, *, data: Any = None, num_steps: int | None = None) -> Callable:
    """The compiled `(state, batches, data inputs) -> (state, outputs)` of several train
    steps (`several_steps`), donating the state: one program for host batches (their
    leading axis sets the count), one per `num_steps` for a device dataset `data`."""
    key = (data, num_steps) if data is not None else None
    if key not in self._chunks:
      step = explaining_errors(self._hooks.train_step, self._hooks)
      self._chunks[key] = self._strategy.compile_train_chunk(
          several_steps(step, self._strategy, data=data, num_steps=num_steps,
                     loop=self._steps_loop), state)
    return self._chunks[key]

  def eval(self, state) -> Callable:
    """The compiled `(state, placed batch) -> metrics`."""
    if self._eval is None:
      self._eval = self._strategy.compile_eval_step(
          explaining_errors(self._hooks.eval_step, self._hooks), state)
    return self._eval

  def predict(self, state) -> Callable:
    """The compiled `(state, placed batch) -> predictions`."""
    if self._predict is None:
      self._predict = self._strategy.compile_eval_step(
          explaining_errors(self._hooks.predict_step, self._hooks), state)
    return self._predict
