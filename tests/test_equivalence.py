"""Data parallelism changes where the work runs, never the result.

pmap data parallel and jit over a mesh (1-D data mesh, and a 2x4 data x model
mesh with logical rules) must give the parameters a single device gives after
several steps on the same global batches, within the float32 noise of the computation
(`tests/numerics.py`: the single-device run from a perturbed init is the yardstick).
"""

import numerics
import numpy as np
import pytest
from conftest import (
  CNNTrainer,
  MLPTrainer,
  cnn_config,
  image_batches,
  leaves,
  mlp_config,
  vector_batches,
)

from configs import mlp_sharded

STEPS = 4

DATA_PARALLEL = {
    "pmap_data_parallel": {"strategy.name": "pmap_data_parallel"},
    "sharded_data_8": {
        "strategy.name": "sharded_data_parallel", "strategy.mesh_shape": (8,),
        "strategy.mesh_axes": ("data",), "strategy.logical_axis_rules": (("batch", "data"),)},
    "sharded_data_model_2x4": {
        "strategy.name": "sharded_data_parallel", "strategy.mesh_shape": (2, 4),
        "strategy.mesh_axes": ("data", "model"),
        "strategy.logical_axis_rules": mlp_sharded.get_config().strategy.logical_axis_rules},
}

MODELS = {
    # (trainer class, config factory, batches)
    "cnn": (CNNTrainer, cnn_config, lambda: image_batches(STEPS, 16)),
    "mlp_sgd": (MLPTrainer, lambda **kw: mlp_config(optimizer="sgd", learning_rate=0.05, **kw),
                lambda: vector_batches(STEPS, 16, 8)),
    "mlp_adam": (MLPTrainer, mlp_config, lambda: vector_batches(STEPS, 16, 8)),
}


def _train(model: str, overrides: dict, *, chaos: bool = False):
  """The canonical parameters after STEPS steps (chaos: of the runs `numerics.chaos_fits`)."""
  trainer_cls, make_config, make_batches = MODELS[model]
  if model == "cnn" and "strategy.logical_axis_rules" in overrides:
    # The CNN annotates no parameter: a table that shards parameters is refused for it.
    overrides = {**overrides, "strategy.logical_axis_rules": (("batch", "data"),)}
  config = make_config(**overrides)
  trainer = trainer_cls(config)
  view = lambda state: trainer.strategy.to_canonical(state.params)  # noqa: E731
  if chaos:
    return numerics.chaos_fits(trainer, make_batches(), num_steps=STEPS, view=view)
  return view(trainer.fit(make_batches(), num_steps=STEPS).state)


@pytest.fixture(scope="module")
def reference():
  """model -> (the single-device parameters, the same run from a perturbed init)."""
  cache = {}

  def get(model):
    if model not in cache:
      single = {"strategy.name": "single_device"}
      cache[model] = (_train(model, single), _train(model, single, chaos=True))
    return cache[model]

  return get


@pytest.mark.parametrize("strategy", sorted(DATA_PARALLEL))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_data_parallel_matches_single_device(model, strategy, reference):
  expected, chaos = reference(model)
  got = _train(model, DATA_PARALLEL[strategy])
  initial = _initial_params(model)
  numerics.assert_equivalent(got, expected, chaos)
  # The comparison is meaningful only if training moved the parameters.
  assert any(not np.allclose(w, s) for w, s in zip(leaves(expected), initial, strict=True))


def _initial_params(model):
  trainer_cls, make_config, make_batches = MODELS[model]
  trainer = trainer_cls(make_config(**{"strategy.name": "single_device"}))
  return leaves(trainer.init_state(make_batches()[0]).params)
