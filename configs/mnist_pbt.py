"""Population-based training of 8 MNIST CNNs in one compiled program: every
`pbt.ready_steps` the bottom quarter copies the state of members drawn from the top
quarter and perturbs the copied learning rate (x0.8 or x1.2, or a fresh draw from
its range), as Jaderberg et al. 2017.

    python examples/mnist_ensemble.py --config=configs/mnist_pbt.py --workdir=/tmp/mnist_pbt

The population starts at 8 learning rates of `configs/mnist_sweep.py`'s grid (seed 0).
`sweep.json` has the lineage (who copied whom, when, with which rates); the best
member is exported as a single-model checkpoint with its final rate.
"""

import ml_collections

from configs import mnist_sweep


def get_config() -> ml_collections.ConfigDict:
  config = mnist_sweep.get_config()
  config.sweep.seeds = (0,)  # 8 members, one per device.
  config.sweep.scheduler = "pbt"
  config.sweep.pbt.ready_steps = 72
  config.sweep.pbt.ranges.learning_rate = (0.002, 0.4)
  config.num_epochs = 1
  config.eval_every_steps = 72
  config.steps_per_call = 4
  config.data.eval_split = "test[:2000]"
  return config
