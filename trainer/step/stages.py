"""The signatures of the train step's stages, and `StepTransform`, the base of the recipe's
transforms that wrap them (`trainer.step.recipe`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
  from strategies import Strategy

PyTree = Any
Batch = Mapping[str, Any]
Rngs = Mapping[str, jax.Array]


class StepAux(NamedTuple):
  """What a (micro)batch's loss carries besides its value."""

  loss: jax.Array  # The mean loss of the examples (unscaled).
  model_state: PyTree  # The model state after the forward pass (BatchNorm statistics).
  metrics: Any  # The hooks' train metrics (a clu collection).


#: `(params, model_state, batch, rngs, train) -> (outputs, model_state)`: the model under a mode.
Forward = Callable[[PyTree, PyTree, Batch, Rngs, bool], tuple[Any, PyTree]]
#: `(params, model_state, batch, key) -> (value to differentiate, StepAux)`.
LossFn = Callable[[PyTree, PyTree, Batch, jax.Array], tuple[jax.Array, StepAux]]
#: `(params, model_state, batch, key) -> (gradients, StepAux)`, per data replica.
GradFn = Callable[[PyTree, PyTree, Batch, jax.Array], tuple[PyTree, StepAux]]
#: `(state, replica-mean gradients, aux, finite) -> new state`.
UpdateFn = Callable[[Any, PyTree, StepAux, jax.Array], Any]


def keep_unless(take: jax.Array, new: Any, state: Any) -> Any:
  """`new` where `take`, else `state` with `new`'s step: an update left out still advances
  the step counter, so the data stays aligned (`SkipNonFinite`, `HoldInactive`, `SkipSpikes`)."""
  kept = state.replace(step=new.step)
  return jax.tree.map(lambda n, o: jnp.where(take, n, o), new, kept)


class StepTransform:
  """One part of the recipe. Override the stages it changes; the others pass through.

  `strategy` gives a transform the step's collectives (`mean_over_data`,
  `constrain_batch`): the functions it returns run inside the compiled step.
  """

  def forward(self, forward: Forward) -> Forward:
    return forward

  def loss(self, loss_fn: LossFn) -> LossFn:
    return loss_fn

  def gradients(self, grad_fn: GradFn, strategy: Strategy) -> GradFn:
    del strategy
    return grad_fn

  def update(self, update_fn: UpdateFn) -> UpdateFn:
    return update_fn

  def init_state(self, state: Any) -> Any:
    """The initial train state with whatever this transform keeps in it."""
    return state

  def eval_variants(self, state: Any) -> dict[str, Any]:
    """Other versions of the state to evaluate beside it, by metric prefix (`ema_`)."""
    del state
    return {}


def differentiated(x: Any) -> bool:
  """Whether the step differentiates the loss for parameter `x` (inexact), or holds it
  constant (integers: a quantized base's codes, `trainer.step.quantized_base`)."""
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def zero_gradient(x: Any) -> jax.Array:
  """The gradient of a parameter: zeros like it, `int8` for one held constant (integer
  codes, whose 4-bit types reductions and norms do not take)."""
  return jnp.zeros_like(x) if differentiated(x) else jnp.zeros(jnp.shape(x), jnp.int8)
