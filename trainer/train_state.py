"""The train state: a flax TrainState that also carries the run's RNG."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax.training import train_state


class TrainState(train_state.TrainState):
  """Params, optimizer state, step and the RNG that step RNGs are folded from.

  The step RNG is `fold_in(rng, step)`: a pure function of the state, so a
  resumed run draws the same randomness as an uninterrupted one.
  """

  rng: jax.Array

  @classmethod
  def create(cls, *, apply_fn, params, tx, rng: jax.Array, **kwargs: Any) -> TrainState:
    state = super().create(apply_fn=apply_fn, params=params, tx=tx, rng=rng, **kwargs)
    # A strongly typed step keeps the step's signature fixed after the first update.
    return state.replace(step=jnp.zeros((), jnp.int32))
