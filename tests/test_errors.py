"""Bad configs fail in the Trainer's constructor, before any model or data work."""

import re

import pytest
from conftest import CNNTrainer, MLPTrainer, cnn_config, image_batches, mlp_config

import strategies


class _NeverBuilt(CNNTrainer):
  """Fails the test if the constructor got as far as building the model."""

  def build_model(self):
    raise AssertionError("the config error must be raised before the model is built")


def test_unknown_strategy_lists_the_valid_names():
  with pytest.raises(ValueError) as err:
    _NeverBuilt(cnn_config(**{"strategy.name": "pmap_ensmble"}))
  message = str(err.value)
  assert "config.strategy.name='pmap_ensmble'" in message
  for name in ("single_device", "pmap_data_parallel", "pmap_ensemble",
               "sharded_data_parallel"):
    assert name in message
  assert set(strategies.available()) >= {"single_device", "pmap_data_parallel",
                                         "pmap_ensemble", "sharded_data_parallel"}


@pytest.mark.parametrize("strategy,overrides", [
    ("pmap_data_parallel", {}),
    ("sharded_data_parallel", {"strategy.mesh_shape": (8,)}),
    ("sharded_data_parallel", {"strategy.mesh_shape": (-1,)}),
])
def test_batch_size_must_split_over_data_replicas(strategy, overrides):
  with pytest.raises(ValueError, match=r"config\.batch_size=12 .*8 data replicas"):
    _NeverBuilt(cnn_config(**{"strategy.name": strategy, "batch_size": 12, **overrides}))


def test_batch_size_counts_only_the_data_axes_of_a_2d_mesh():
  # 2 data replicas on a 2x4 mesh: 6 examples split, 5 do not.
  MLPTrainer(mlp_config(batch_size=6, eval_batch_size=6))
  with pytest.raises(ValueError, match=r"config\.batch_size=5 .*2 data replicas"):
    MLPTrainer(mlp_config(batch_size=5))


@pytest.mark.parametrize("value", [0, -8])
def test_eval_batch_size_must_be_a_positive_integer(value):
  # Any positive size works (eval pads); zero or negative sizes do not.
  with pytest.raises(ValueError, match=rf"config\.eval_batch_size={value} must be a positive"):
    _NeverBuilt(cnn_config(**{"strategy.name": "pmap_data_parallel", "eval_batch_size": value}))


def test_mesh_shape_must_cover_the_devices():
  with pytest.raises(ValueError, match=re.escape(
      "config.strategy.mesh_shape=(2, 2) covers 4 devices but 8 are available")):
    _NeverBuilt(cnn_config(**{"strategy.name": "sharded_data_parallel",
                              "strategy.mesh_shape": (2, 2),
                              "strategy.mesh_axes": ("data", "model")}))


def test_mesh_shape_and_axes_must_agree():
  with pytest.raises(ValueError, match=r"mesh_shape=\(8,\) and config\.strategy\.mesh_axes="):
    _NeverBuilt(cnn_config(**{"strategy.name": "sharded_data_parallel",
                              "strategy.mesh_shape": (8,),
                              "strategy.mesh_axes": ("data", "model")}))


def test_pmap_ensemble_needs_one_member_per_device():
  with pytest.raises(ValueError, match=r"config\.ensemble_size=4 .*8 local devices"):
    _NeverBuilt(cnn_config(**{"strategy.name": "pmap_ensemble", "ensemble_size": 4}))


def test_rule_naming_a_missing_mesh_axis():
  with pytest.raises(ValueError, match=re.escape(
      "maps 'hidden' to mesh axis 'tensor', but the mesh axes are ('data', 'model')")):
    MLPTrainer(mlp_config(**{"strategy.logical_axis_rules": (("batch", "data"),
                                                             ("hidden", "tensor"))}))


def test_unknown_optimizer():
  with pytest.raises(ValueError, match=r"config\.optimizer='lamb' .*sgd, adam, adamw"):
    CNNTrainer(cnn_config(optimizer="lamb"))


def test_batch_of_the_wrong_size_is_named():
  trainer = CNNTrainer(cnn_config(**{"strategy.name": "pmap_data_parallel"}))
  with pytest.raises(ValueError, match="leading dimension 12 does not split over 8"):
    trainer.strategy.put_batch(image_batches(1, 12)[0])


@pytest.mark.parametrize("size,mesh,numbers", [
    (12, (8, 1), "config.ensemble_size=12 does not divide over the 8 devices of mesh axis "
                 "'ensemble'"),
    (6, (4, 2), "config.ensemble_size=6 does not divide over the 4 devices of mesh axis "
                "'ensemble'"),
])
def test_sharded_ensemble_size_must_divide_over_the_ensemble_axis(size, mesh, numbers):
  with pytest.raises(ValueError, match=re.escape(numbers) + r".*multiple of"):
    _NeverBuilt(cnn_config(**{"strategy.name": "sharded_ensemble", "ensemble_size": size,
                              "strategy.ensemble_mesh_shape": mesh}))


@pytest.mark.parametrize("field,value,message", [
    ("strategy.ensemble_mesh_shape", (3, 3), "needs 9 devices but 8 are available"),
    ("strategy.ensemble_mesh_shape", (8,), "must be two positive integers"),
    ("strategy.ensemble_loop", "scan",
     "ensemble_loop='scan' is not one of ('unroll', 'map', 'vmap')"),
])
def test_sharded_ensemble_mesh_and_loop_are_checked(field, value, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    _NeverBuilt(cnn_config(**{"strategy.name": "sharded_ensemble", field: value}))


@pytest.mark.parametrize("overrides,message", [
    ({"schedule.name": "step"}, "config.schedule.name='step' is not one of ('constant', "
                                "'cosine', 'linear')"),
    ({"schedule.name": "cosine", "num_train_steps": 20, "schedule.warmup_steps": 20},
     "num_train_steps=20 must exceed config.schedule.warmup_steps=20"),
    ({"schedule.name": "linear", "num_train_steps": -1},
     "config.schedule.name='linear' decays over the run, so it needs the run's length"),
    ({"grad_accum_steps": 3}, "config.grad_accum_steps=3 must be a positive integer that "
                              "divides the 16 examples"),
    ({"grad_accum_steps": 4, "strategy.name": "pmap_data_parallel"},
     "config.grad_accum_steps=4 must be a positive integer that divides the 2 examples each "
     "of the 8 data replica(s)"),
    ({"ema_decay": 1.0}, "config.ema_decay=1.0 must be in [0, 1)"),
    ({"mixed_precision.compute_dtype": "fp8"},
     "config.mixed_precision.compute_dtype='fp8' is not one of ('float32', 'bfloat16', "
     "'float16')"),
])
def test_recipe_fields_are_checked_before_the_model_is_built(overrides, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    _NeverBuilt(cnn_config(**overrides))


@pytest.mark.parametrize("overrides,message", [
    ({"grad_clip_norm": -1.0}, "config.grad_clip_norm=-1.0 must be >= 0"),
    ({"weight_decay": -0.1}, "config.weight_decay=-0.1 must be >= 0"),
])
def test_optimizer_fields_are_checked_in_the_constructor(overrides, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    CNNTrainer(cnn_config(**overrides))


@pytest.mark.parametrize("overrides,message", [
    ({"early_stopping.metric": "nll"}, "config.early_stopping.metric='nll' needs periodic "
                                       "evaluations, but config.eval_every_steps=0"),
    ({"early_stopping.metric": "nll", "eval_every_steps": 5, "early_stopping.mode": "up"},
     "config.early_stopping.mode='up' must be 'min' or 'max'"),
    ({"profile.num_steps": 2}, "config.profile.num_steps=2 but there is no directory"),
])
def test_loop_fields_are_checked_before_the_first_step(overrides, message):
  class NoStep(CNNTrainer):
    def init_state(self, *args, **kwargs):
      raise AssertionError("the error must come before the state is made")

  batches = image_batches(2, 16)
  with pytest.raises(ValueError, match=re.escape(message)):
    NoStep(cnn_config(**overrides)).fit(batches, num_steps=2, eval_batches=lambda: batches)
