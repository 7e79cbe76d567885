"""The training recipe as step transforms: each wraps one stage of the train step.

A train step is four stages, each a pure function built once:

    forward(params, model_state, batch, rngs, train) -> (outputs, model_state)
    loss(params, model_state, batch, key)            -> (value to differentiate, StepAux)
    gradients(params, model_state, batch, key)       -> (grads, StepAux)
    update(state, grads, aux, finite)                -> state

A `StepTransform` wraps any of them and returns the wrapped function (the
identity by default), in the manner of Levanter's `microbatched(grad_fn)` and
optax's `apply_if_finite`. A `Recipe` is the ordered list of transforms: each
stage is wrapped by the transforms in list order, so a later transform sees
(and wraps) the earlier ones. `recipe_from_config` assembles the standard one;
a user appends their own (`Trainer.build_recipe`) without editing the step.

Forward runs in train and eval alike (mixed precision applies to both); the
other three stages exist only in the train step. Gradients leave the
gradient stage per data replica: the step averages them over replicas
(`Strategy.mean_over_data`) before the update stage.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from strategies import Strategy
from trainer.step import accumulation, spikes
from trainer.step.precision import Precision
from trainer.step.stages import (
  Forward,
  GradFn,
  LossFn,
  StepAux,
  StepTransform,
  UpdateFn,
  differentiated,
  keep_unless,
)
from trainer.step.train_state import EmaTrainState

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Recipe:
  """An ordered tuple of transforms, applied stage by stage in that order."""

  transforms: tuple[StepTransform, ...] = ()

  def __add__(self, more) -> Recipe:
    return Recipe(self.transforms + tuple(more))

  def _through(self, stage: str, value: Any, *args: Any) -> Any:
    """`value` passed through every transform's `stage`, in order."""
    for t in self.transforms:
      value = getattr(t, stage)(value, *args)
    return value

  def forward(self, fn: Forward) -> Forward:
    return self._through("forward", fn)

  def loss(self, fn: LossFn) -> LossFn:
    return self._through("loss", fn)

  def gradients(self, fn: GradFn, strategy: Strategy) -> GradFn:
    return self._through("gradients", fn, strategy)

  def update(self, fn: UpdateFn) -> UpdateFn:
    return self._through("update", fn)

  def init_state(self, state: Any) -> Any:
    return self._through("init_state", state)

  def eval_variants(self, state: Any) -> dict[str, Any]:
    """`{"": state}` and every transform's variants (e.g. `{"ema_": ...}`)."""
    variants = {"": state}
    for t in self.transforms:
      variants.update(t.eval_variants(state))
    return variants

  @property
  def skips_nonfinite(self) -> bool:
    """Whether a non-finite update is left out (and counted) rather than an error."""
    return any(isinstance(t, SkipNonFinite) for t in self.transforms)

  @property
  def skips_spikes(self) -> bool:
    """Whether the state keeps a loss history and updates far above it are left out."""
    return any(isinstance(t, spikes.SkipSpikes) for t in self.transforms)


# -- The standard recipe's transforms ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MixedPrecision(StepTransform):
  """Computes in `precision.compute_dtype` (train and eval), with a static loss scale.

  Parameters and floating inputs are cast to the compute dtype for the
  forward pass and outputs back to float32; the model state keeps its dtypes
  (float32 BatchNorm statistics). With a loss scale the differentiated loss
  is scaled and each (micro)batch's gradients unscaled.
  """

  precision: Precision

  def forward(self, forward: Forward) -> Forward:
    p = self.precision
    if not p.is_mixed:
      return forward

    def cast(params, model_state, batch, rngs, train):
      outputs, new_state = forward(p.to_compute(params), model_state, p.to_compute(batch),
                                   rngs, train)
      new_state = jax.tree.map(lambda new, old: jnp.asarray(new, old.dtype), new_state,
                               model_state)
      return p.to_float32(outputs), new_state

    return cast

  def loss(self, loss_fn: LossFn) -> LossFn:
    scale = self.precision.loss_scale
    if scale == 1.0:
      return loss_fn

    def scaled(params, model_state, batch, key):
      value, aux = loss_fn(params, model_state, batch, key)
      return value * scale, aux

    return scaled

  def gradients(self, grad_fn: GradFn, strategy: Strategy) -> GradFn:
    del strategy
    scale = self.precision.loss_scale
    if scale == 1.0:
      return grad_fn

    def unscaled(params, model_state, batch, key):
      grads, aux = grad_fn(params, model_state, batch, key)
      return jax.tree.map(lambda g: g / scale, grads), aux

    return unscaled


@dataclasses.dataclass(frozen=True)
class Accumulate(StepTransform):
  """`steps` microbatches inside one compiled step; see `trainer.step.accumulation`."""

  steps: int
  loop: str = "scan"

  def gradients(self, grad_fn: GradFn, strategy: Strategy) -> GradFn:
    if self.steps == 1:
      return grad_fn
    return accumulation.microbatched(grad_fn, self.steps, loop=self.loop,
                                     constrain=strategy.constrain_batch)


@dataclasses.dataclass(frozen=True)
class Ema(StepTransform):
  """An exponential moving average of the parameters, kept in the state (`ema_params`).

  After every update `ema = decay * ema + (1 - decay) * params`, starting from
  the initial parameters; evaluated beside the parameters as `ema_*`. With
  `in_state` the decay is an array in the state (`ema_decay`), so each member of
  a sweep can have its own (`trainer.sweep`).
  """

  decay: float
  in_state: bool = False

  def init_state(self, state):
    if not hasattr(state, "ema_params"):
      state = EmaTrainState(**{f.name: getattr(state, f.name)
                               for f in dataclasses.fields(state) if f.init})
    state = state.replace(ema_params=state.params)
    if self.in_state:
      state = state.replace(ema_decay=jnp.asarray(self.decay, jnp.float32))
    return state

  def update(self, update_fn: UpdateFn) -> UpdateFn:
    def with_average(state, grads, aux, finite):
      new = update_fn(state, grads, aux, finite)
      decay = state.ema_decay if self.in_state else self.decay
      average = lambda n, o: (optax.incremental_update(n, o, 1.0 - decay)  # noqa: E731
                              if differentiated(n) else n)  # Integer codes: constants.
      return new.replace(ema_params=jax.tree.map(average, new.params, state.ema_params))

    return with_average

  def eval_variants(self, state):
    return {"ema_": state.replace(params=state.ema_params)}


class SkipNonFinite(StepTransform):
  """Keeps the previous parameters and optimizer state when `finite` is False (a NaN or inf
  loss or gradient norm), as `optax.apply_if_finite` does; the step counter still advances,
  so the data stays aligned. The loop counts the skipped steps."""

  def update(self, update_fn: UpdateFn) -> UpdateFn:
    def guarded(state, grads, aux, finite):
      new = update_fn(state, grads, aux, finite)
      return keep_unless(finite, new, state)

    return guarded


class HoldInactive(StepTransform):
  """Keeps a member's whole state (parameters, model state, optimizer state, EMA) where
  its optimizer's injected `active` hyperparameter is 0: a sweep slot frozen by its
  scheduler (`trainer.sweep.select`). The step counter still advances, so the data stays
  aligned; the step is still computed (every member runs the same program)."""

  def update(self, update_fn: UpdateFn) -> UpdateFn:
    def held(state, grads, aux, finite):
      new = update_fn(state, grads, aux, finite)
      active = state.opt_state.hyperparams["active"] > 0
      return keep_unless(active, new, state)

    return held


#: What `config.nonfinite` may say a train step does with a non-finite loss or gradient.
NONFINITE_ACTIONS = ("stop", "skip")


def recipe_from_config(config: ml_collections.ConfigDict, *, num_data_replicas: int,
                       strategy_name: str) -> Recipe:
  """The standard recipe the config asks for: precision, accumulation, EMA, the spike guard
  (`trainer.step.spikes`), non-finite skip.

  Raises:
    ValueError: a recipe field out of range (named, with its value and what is accepted).
  """
  transforms: list[StepTransform] = []
  precision = Precision.from_config(config)
  if precision.is_mixed or precision.loss_scale != 1.0:
    transforms.append(MixedPrecision(precision))
  steps, loop = accumulation.from_config(config, num_data_replicas=num_data_replicas,
                                         strategy_name=strategy_name)
  if steps > 1:
    transforms.append(Accumulate(steps, loop))
  check_config(config)
  ema = config.ema_decay
  swept = len(config.sweep.grid.ema_decay) > 0 or any("ema_decay" in p
                                                      for p in config.sweep.points)
  if ema or swept:  # A sweep of the decay keeps it in the state, per member.
    transforms.append(Ema(float(ema), in_state=swept))
  guard = spikes.from_config(config)
  if guard is not None:
    transforms.append(guard)
  if config.nonfinite == "skip":
    transforms.append(SkipNonFinite())
  if config.sweep.scheduler == "halving":  # A slot with nothing left to try is frozen.
    transforms.append(HoldInactive())
  return Recipe(tuple(transforms))


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises unless `ema_decay`, `nonfinite` and `spikes` are usable (the other recipe fields are
  checked by their parts: `Precision.from_config`, `accumulation.from_config`).

  Raises:
    ValueError: naming the field, its value and what is accepted.
  """
  ema = config.ema_decay
  if not isinstance(ema, (int, float)) or not 0.0 <= ema < 1.0:
    raise ValueError(f"config.ema_decay={ema!r} must be in [0, 1) (0: no EMA of the "
                     f"parameters).")
  if config.nonfinite not in NONFINITE_ACTIONS:
    raise ValueError(f"config.nonfinite={config.nonfinite!r} is not one of "
                     f"{NONFINITE_ACTIONS}: 'stop' raises at the first non-finite loss or "
                     f"gradient norm, 'skip' leaves such updates out and counts them.")
  spikes.check_config(config)


__all__ = ["Accumulate", "Ema", "HoldInactive", "MixedPrecision", "Recipe", "SkipNonFinite",
           "StepAux", "StepTransform", "check_config", "recipe_from_config"]
