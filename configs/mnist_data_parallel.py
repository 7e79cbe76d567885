"""One MNIST CNN, data parallel under pmap over all local devices."""

import ml_collections

from configs import mnist_ensemble


def get_config() -> ml_collections.ConfigDict:
  config = mnist_ensemble.get_config()
  config.strategy.name = "pmap_data_parallel"
  return config
