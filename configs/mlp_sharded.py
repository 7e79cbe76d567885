"""The logical-axis MLP on a 2x4 ('data', 'model') mesh: data x tensor parallel."""

import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  config.model = ml_collections.ConfigDict()
  config.model.num_layers = 4
  config.model.depth = 64
  config.model.embed = 16
  config.batch_size = 32
  config.eval_batch_size = 32
  config.optimizer = "adam"
  config.learning_rate = 1e-3
  config.strategy.name = "sharded_data_parallel"
  config.strategy.mesh_shape = (2, 4)
  config.strategy.mesh_axes = ("data", "model")
  config.strategy.logical_axis_rules = (("batch", "data"), ("hidden", "model"),
                                        ("embed", None), ("layer", None))
  return config
