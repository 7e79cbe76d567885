"""One MNIST CNN under jit over a ('data',) mesh of all devices."""

import ml_collections

from configs import mnist_ensemble


def get_config() -> ml_collections.ConfigDict:
  config = mnist_ensemble.get_config()
  config.strategy.name = "sharded_data_parallel"
  config.strategy.mesh_shape = (-1,)
  config.strategy.mesh_axes = ("data",)
  config.strategy.logical_axis_rules = (("batch", "data"),)
  return config
