"""A learning-rate sweep trained as one ensemble: 8 learning rates x 2 seeds = 16 MNIST CNNs
in one compiled program, 2 per device on 8 devices.

    python examples/mnist_ensemble.py --config=configs/mnist_sweep.py \
        --workdir=/tmp/mnist_sweep

Each member is the single-model run with its learning rate and seed
(trainer/sweep/). At the end the workdir holds `sweep.json` (every member's
eval metrics), `sweep.png` (accuracy against the learning rate) and the best
member as a single-model checkpoint (`sweep_best/`, with
`sweep_best_config.json`: resume it under any single-model strategy).
"""

import ml_collections

from configs import mnist_ensemble


def get_config() -> ml_collections.ConfigDict:
  config = mnist_ensemble.get_config()
  config.strategy.name = "sharded_ensemble"  # 16 members over the 'ensemble' axis: 2 each.
  config.ensemble_size = 0  # The sweep's member count.
  config.num_cpu_devices = 8  # CPU-only hosts; no effect on GPU/TPU.
  config.sweep.grid.learning_rate = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4)
  config.sweep.seeds = (0, 1)
  config.sweep.metric = "accuracy"
  config.sweep.mode = "max"
  # A member that diverges (a large rate) skips its non-finite updates instead of
  # stopping the other 15 (each member's update is checked on its own).
  config.nonfinite = "skip"
  config.num_epochs = 2
  config.data.pipeline = "device"  # The split on the devices, 4 steps a call.
  config.steps_per_call = 4
  return config
