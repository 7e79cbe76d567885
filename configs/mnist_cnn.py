"""One MNIST CNN; `--config.strategy.name` picks how it is parallelised."""

import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  config.ensemble_size = 1  # Read by ensemble strategies only.
  config.strategy.name = "single_device"
  return config
