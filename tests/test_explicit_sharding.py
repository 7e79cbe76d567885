"""Explicit sharding (`config.strategy.axis_types="explicit"`) with a model written the way
Flax's current NNX examples write one: a mesh `PartitionSpec` on each weight, no rule table."""

import flax.linen as nn
import jax
import numerics
import numpy as np
import pytest
from conftest import MLPTrainer, leaves, mlp_config, vector_batches
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from user_models import MiniGptTrainer

import configs.base as base
from trainer.checkpoint import Checkpointer
from trainer.language_model import synthetic_token_batches

STEPS = 3
MESH = {"strategy.name": "sharded_data_parallel", "strategy.mesh_shape": (2, 4),
        "strategy.mesh_axes": ("data", "model")}


def gpt_config(**overrides):
  config = base.get_config()
  config.batch_size = config.eval_batch_size = 8
  config.log_every_steps = 100
  config.optimizer, config.learning_rate = "sgd", 0.5  # Adam would magnify rounding noise.
  config.update_from_flattened_dict(overrides)
  return config


def token_batches(num: int = STEPS):
  return [b for b, _ in zip(synthetic_token_batches(0, 8, 8, 32), range(num), strict=False)]


def train(workdir=None, **overrides):
  trainer = MiniGptTrainer(gpt_config(**overrides))
  checkpointer = Checkpointer(workdir) if workdir else None
  try:
    result = trainer.fit(token_batches(), num_steps=STEPS, checkpointer=checkpointer)
  finally:
    if checkpointer:
      checkpointer.close()
  return trainer, result.state


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("explicit")
  single = train()
  chaos = numerics.chaos_fits(single[0], token_batches(), num_steps=STEPS,
                              view=lambda state: canonical((single[0], state)))
  return {"single": single, "chaos": chaos, "auto": train(**MESH),
          "explicit": train(workdir, **MESH, **{"strategy.axis_types": "explicit"}),
          "workdir": workdir}


def canonical(run):
  trainer, state = run
  return jax.device_get(trainer.strategy.to_canonical(nn.meta.unbox(state.params)))


def test_the_mesh_has_explicit_axes_and_the_weights_are_laid_out_as_written(runs):
  trainer, state = runs["explicit"]
  assert trainer.strategy.mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
  assert "explicit mesh (data=2, model=4)" in trainer.strategy.describe()
  block = state.params["blocks"][0]
  want = {("up", "kernel"): (P(None, "model"), (16, 8)),
          ("down", "kernel"): (P("model", None), (8, 16)),
          ("attention", "query", "kernel"): (P(None, "model"), (16, 1, 4)),
          ("norm1", "scale"): (P("model"), (4,))}
  for path, (spec, shard_shape) in want.items():
    box = block
    for key in path:
      box = box[key]
    array = box.value
    assert array.sharding.spec == spec, path
    assert {s.data.shape for s in array.addressable_shards} == {shard_shape}, path
  embedding = state.params["tokens"]["embedding"].value
  assert embedding.sharding.spec == P(None, "model")


def test_explicit_trains_equal_to_one_device_and_to_auto(runs):
  single, auto, explicit = (canonical(runs[k]) for k in ("single", "auto", "explicit"))
  initial = canonical((runs["single"][0], runs["single"][0].init_state(token_batches(1)[0])))
  moved = False
  numerics.assert_equivalent(explicit, single, runs["chaos"])
  numerics.assert_equivalent(explicit, auto, runs["chaos"])  # The same noise around auto.
  for want, start in zip(leaves(single), leaves(initial), strict=True):
    moved |= not np.allclose(want, start)
  assert moved


@pytest.mark.parametrize("strategy", [
    {"strategy.name": "single_device"}, {"strategy.name": "pmap_data_parallel"},
    {**MESH, "strategy.mesh_shape": (8, 1)}])
def test_an_explicit_checkpoint_restores_under_another_strategy(runs, strategy):
  trainer = MiniGptTrainer(gpt_config(**strategy))
  checkpointer = Checkpointer(runs["workdir"])
  try:
    state = trainer.restore_checkpoint(checkpointer, token_batches(1)[0])
  finally:
    checkpointer.close()
  for want, got in zip(leaves(canonical(runs["explicit"])), leaves(canonical((trainer, state))),
                       strict=True):
    np.testing.assert_array_equal(got, want)


def test_a_linen_data_parallel_model_trains_under_explicit_axes_as_under_auto():
  # The logical-axis MLP with the plain data-parallel table (its weights replicated): its
  # activation constraints are off under explicit; the batch's sharding carries through.
  batches = vector_batches(STEPS, 16, 8)
  got = {}
  for axis_types in ("auto", "explicit"):
    trainer = MLPTrainer(mlp_config(**{
        "strategy.axis_types": axis_types, "strategy.mesh_shape": (8,),
        "strategy.mesh_axes": ("data",), "strategy.logical_axis_rules": (("batch", "data"),)}))
    state = trainer.fit(batches, num_steps=STEPS).state
    assert state.params["layers"]["W1"].value.sharding.spec == P(None, None, None)
    got[axis_types] = jax.device_get(trainer.strategy.to_canonical(nn.meta.unbox(state.params)))
  for a, b in zip(leaves(got["auto"]), leaves(got["explicit"]), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_an_unknown_axis_type_is_refused_naming_the_field():
  with pytest.raises(ValueError, match=r"config.strategy.axis_types='manual' is not one of "
                                       r"\('auto', 'explicit'\)"):
    MiniGptTrainer(gpt_config(**MESH, **{"strategy.axis_types": "manual"}))


def test_a_deprecated_jax_api_fails_the_suite():
  # pyproject.toml's filter: `with mesh:` is deprecated since jax 0.10.1 (use jax.set_mesh).
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  with pytest.raises(DeprecationWarning, match=r"jax.set_mesh"):
    with mesh:
      pass
