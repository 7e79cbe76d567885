"""The signatures of the train step's stages, which the recipe's transforms wrap."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax

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
