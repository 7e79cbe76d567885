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
