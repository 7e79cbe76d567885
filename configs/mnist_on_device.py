"""The flagship with the host out of the loop: the 8-member MNIST ensemble, its train split
on the devices and 16 train steps per compiled call.

    python examples/mnist_ensemble.py --config=configs/mnist_on_device.py \
        --workdir=/tmp/mnist_on_device

The same model, data order and results as configs/mnist_ensemble.py (see the
README's "Several steps per call" section for what changes and what does not
combine): the host dispatches one call per 16 steps and reads no batches.
`sharded_ensemble` puts the members on any number of devices: all 8 on one
GPU, or one per device on 8 (on a CPU-only host, `num_cpu_devices` of them).
"""

import ml_collections

from configs import mnist_ensemble


def get_config() -> ml_collections.ConfigDict:
  config = mnist_ensemble.get_config()
  config.strategy.name = "sharded_ensemble"
  config.data.pipeline = "device"  # The 47 MB of uint8 train images live on every device.
  # 16 steps a call: 468 steps an epoch (a checkpoint each) run as 29 calls of 16 and
  # one of 4. Larger k buys little once the host is out of the loop
  # (benchmarks/steps_per_call.py), and on CPU, where the steps are unrolled,
  # compiles longer.
  config.steps_per_call = 16
  return config
