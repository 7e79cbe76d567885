"""A step transform the recipe does not have, added from outside `trainer/`: sharpness-aware
minimisation (SAM, Foret et al. 2021), which evaluates the gradient a second time at
parameters moved up the gradient by `rho`. Nothing in the train step is edited."""

import jax
import numpy as np
import optax
import pytest
from conftest import SHARDED_8, MLPTrainer, leaves, mlp_config, vector_batches

from trainer import StepTransform


class SAM(StepTransform):
  """Gradients at `params + rho * g / |g|`, with `g` the batch's (replica-mean) gradient."""

  def __init__(self, rho: float):
    self.rho = rho

  def gradients(self, grad_fn, strategy):
    def sharpness_aware(params, model_state, batch, key):
      grads, _ = grad_fn(params, model_state, batch, key)
      grads = strategy.mean_over_data(grads)  # The global batch's direction, as on one device.
      scale = self.rho / (optax.tree.norm(grads) + 1e-12)
      ascended = jax.tree.map(lambda p, g: p + scale * g, params, grads)
      return grad_fn(ascended, model_state, batch, key)

    return sharpness_aware


class SAMTrainer(MLPTrainer):
  def build_recipe(self):
    return super().build_recipe() + [SAM(rho=0.5)]


STEPS = 4


@pytest.fixture(scope="module")
def runs():
  batches = vector_batches(STEPS, 16, 8)
  out = {}
  for name, trainer_cls, overrides in (
      ("plain", MLPTrainer, {"strategy.name": "single_device"}),
      ("sam", SAMTrainer, {"strategy.name": "single_device"}),
      ("sam_pmap", SAMTrainer, {"strategy.name": "pmap_data_parallel"}),
      ("sam_jit", SAMTrainer, SHARDED_8)):
    trainer = trainer_cls(mlp_config(learning_rate=0.05, **overrides))
    result = trainer.fit(batches, num_steps=STEPS, eval_batches=lambda: batches[:1])
    out[name] = (trainer.strategy.to_canonical(result.state.params), result.final_eval)
  return out


def test_sam_changes_the_updates(runs):
  assert not all(np.allclose(a, b, rtol=1e-3) for a, b in zip(
      leaves(runs["sam"][0]), leaves(runs["plain"][0]), strict=True))


@pytest.mark.parametrize("name", ["sam_pmap", "sam_jit"])
def test_sam_trains_under_data_parallelism_as_on_one_device(runs, name):
  for got, want in zip(leaves(runs[name][0]), leaves(runs["sam"][0]), strict=True):
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
  assert np.isfinite(runs[name][1]["loss"])
