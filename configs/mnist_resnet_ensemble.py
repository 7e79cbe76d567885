"""An 8-member ensemble of small BatchNorm ResNets on MNIST, one member per device under pmap.

    python examples/mnist_ensemble.py --config=configs/mnist_resnet_ensemble.py \
        --workdir=/tmp/mnist_resnet

Each member keeps its own BatchNorm statistics (per member, over the whole
batch it sees); `--config.strategy.name=pmap_data_parallel` trains one ResNet
whose statistics are over the global batch, as on one device.
"""

import ml_collections

from configs import mnist_ensemble


def get_config() -> ml_collections.ConfigDict:
  config = mnist_ensemble.get_config()
  config.model.name = "resnet"
  config.model.stage_sizes = (1, 1, 1)  # Channels 8, 16, 32; strides 1, 2, 2.
  config.model.num_filters = 8
  config.num_epochs = 2  # About 5 min for 8 members on 2 CPU cores.
  return config
