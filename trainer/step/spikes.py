"""Loss spikes: an update whose loss is far above the recent ones is left out.

A finite but wrong loss (a bad batch, a mixed-precision overflow just under inf)
passes `nonfinite="skip"`, and one such update can undo hours of training.
`SkipSpikes` (`config.spikes`, off by default) keeps the last `window` losses
in the train state (`TrainState.spikes`) and, once `warmup` of them are
recorded, keeps the previous parameters, optimizer state, model state and EMA
whenever a step's loss exceeds `factor` times their median, as MaxText's
`skip_step_on_spikes` and Lightning's `SpikeDetection` do. The step counter
still advances, so the data stays aligned.

Everything happens on the device, inside the compiled step: the loss is the
mean over all data replicas (one decision for all of them), and in an
ensemble or a sweep each member has its own history, so a spiking member
skips and the others do not. A skipped loss is not recorded, so the median
stays that of the accepted steps. The history is part of the state: it is
checkpointed, so a resumed run skips exactly what an uninterrupted one
does. The loop's `trainer.loop.builtin.ReportSpikes` writes the count as
`train/spike_skips`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import ml_collections

from strategies import Strategy
from trainer.step.stages import GradFn, StepTransform, UpdateFn, keep_unless


@flax.struct.dataclass
class SpikeHistory:
  """The spike guard's state, per model (stacked per member in an ensemble).

  Attributes:
    losses: the last `window` accepted losses (a ring; NaN where none yet).
    count: how many losses were accepted so far (the ring's next slot is `count % window`).
    skips: how many updates were left out as spikes.
  """

  losses: jax.Array
  count: jax.Array
  skips: jax.Array

  @classmethod
  def empty(cls, window: int) -> SpikeHistory:
    return cls(losses=jnp.full((window,), jnp.nan, jnp.float32),
               count=jnp.zeros((), jnp.int32), skips=jnp.zeros((), jnp.int32))


@dataclasses.dataclass(frozen=True)
class SkipSpikes(StepTransform):
  """Leaves out an update whose loss exceeds `factor` x the median of the last `window`
  accepted losses, once `warmup` losses are recorded (see the module docstring)."""

  factor: float
  window: int
  warmup: int

  def init_state(self, state: Any) -> Any:
    return state.replace(spikes=SpikeHistory.empty(self.window))

  def gradients(self, grad_fn: GradFn, strategy: Strategy) -> GradFn:
    """The loss the guard reads is the mean over data replicas, so they all decide alike."""
    def global_loss(params, model_state, batch, key):
      grads, aux = grad_fn(params, model_state, batch, key)
      return grads, aux._replace(loss=strategy.mean_over_data(aux.loss))

    return global_loss

  def update(self, update_fn: UpdateFn) -> UpdateFn:
    def guarded(state, grads, aux, finite):
      new = update_fn(state, grads, aux, finite)
      history = state.spikes
      loss = jnp.asarray(aux.loss, jnp.float32)
      median = jnp.nanmedian(history.losses)
      spike = (history.count >= self.warmup) & jnp.isfinite(loss) & (loss > self.factor * median)
      out = keep_unless(~spike, new, state)
      record = jnp.isfinite(loss) & ~spike
      slot = history.count % self.window
      losses = jnp.where(record, history.losses.at[slot].set(loss), history.losses)
      return out.replace(spikes=SpikeHistory(
          losses=losses, count=history.count + record.astype(jnp.int32),
          skips=history.skips + spike.astype(jnp.int32)))

    return guarded


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises unless `config.spikes` is usable.

  Raises:
    ValueError: naming the field, its value and what is accepted.
  """
  s = config.spikes
  if not isinstance(s.skip, bool):
    raise ValueError(f"config.spikes.skip={s.skip!r} must be True or False.")
  if not isinstance(s.factor, (int, float)) or isinstance(s.factor, bool) or s.factor <= 1.0:
    raise ValueError(f"config.spikes.factor={s.factor!r} must be a number > 1: an update is "
                     f"skipped when its loss exceeds factor x the median of the recent losses.")
  if not isinstance(s.window, int) or s.window < 1:
    raise ValueError(f"config.spikes.window={s.window!r} must be an integer >= 1 (how many "
                     f"recent losses the median is taken over).")
  if not isinstance(s.warmup, int) or not 1 <= s.warmup <= s.window:
    raise ValueError(f"config.spikes.warmup={s.warmup!r} must be an integer in [1, "
                     f"config.spikes.window={s.window}]: how many losses are recorded before "
                     f"any step can be skipped.")


def from_config(config: ml_collections.ConfigDict) -> SkipSpikes | None:
  """The guard `config.spikes` asks for, or None when it is off (checked by `check_config`,
  which `trainer.config.check_config` and `recipe_from_config` call first)."""
  s = config.spikes
  return SkipSpikes(float(s.factor), s.window, s.warmup) if s.skip else None
