"""The train state: a flax TrainState that also carries the run's RNG and the model's state."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state


class TrainState(train_state.TrainState):
  """Params, optimizer state, model state, step and the RNG that step RNGs are folded from.

  `model_state` holds the model's variables other than params (e.g. BatchNorm's
  `batch_stats`): the train step replaces it, eval reads it, checkpoints keep
  it. The step RNG is `fold_in(rng, step)`: a pure function of the state, so a
  resumed run draws the same randomness as an uninterrupted one.
  """

  rng: jax.Array
  model_state: Any = None
  #: The spike guard's loss history (`trainer.step.spikes.SpikeHistory`); None (no leaf)
  #: when `config.spikes.skip` is off.
  spikes: Any = None

  @classmethod
  def create(cls, *, apply_fn, params, tx, rng: jax.Array, model_state: Any = None,
             **kwargs: Any) -> TrainState:
    state = super().create(apply_fn=apply_fn, params=params, tx=tx, rng=rng,
                           model_state={} if model_state is None else model_state, **kwargs)
    # A strongly typed step keeps the step's signature fixed after the first update.
    return state.replace(step=jnp.zeros((), jnp.int32))

  def apply_gradients(self, *, grads: Any, **kwargs: Any) -> TrainState:
    """Flax's update; parameters the step holds constant (a quantized base's integer
    codes, `trainer.step.stages.differentiated`) keep their values."""
    from trainer.step.stages import differentiated

    if all(differentiated(x) for x in jax.tree.leaves(self.params)):
      return super().apply_gradients(grads=grads, **kwargs)
    updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
    params = jax.tree.map(lambda p, u: optax.apply_updates(p, u) if differentiated(p) else p,
                          self.params, updates)
    return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **kwargs)


class EmaTrainState(TrainState):
  """A TrainState that also keeps an exponential moving average of the parameters.

  The recipe's `Ema` transform sets `ema_params` to the initial parameters and
  updates it after every update. The average is part of the state, so it is
  checkpointed, restored under any strategy and laid out like `params`.
  """

  ema_params: Any = None
  #: The decay as an array, when it is part of the state (a sweep's per-member decay);
  #: None (no leaf, the checkpoint layout of a fixed decay) otherwise.
  ema_decay: Any = None
