"""A learning-rate range test on MNIST in one compiled program: 16 CNNs from the same seed
at learning rates log-spaced over [1e-3, 10], 300 steps each, the train loss of each
recorded at every step.

    python examples/mnist_ensemble.py --config=configs/mnist_lr_find.py \
        --workdir=/tmp/mnist_lr_find

At the end the log suggests a rate (where the final loss falls fastest against the
rate), and the workdir has `lr_find.json` and `lr_find.png` (trainer/sweep/lr_find.py;
`trainer.sweep.lr_find_config` sets up any config the same way).
"""

import ml_collections
import numpy as np

from configs import mnist_sweep


def get_config() -> ml_collections.ConfigDict:
  config = mnist_sweep.get_config()
  config.sweep.grid.learning_rate = tuple(float(x) for x in np.geomspace(1e-3, 10.0, 16))
  config.sweep.seeds = (0,)
  config.sweep.lr_find = True
  config.num_epochs = 0
  config.num_train_steps = 300
  config.data.eval_split = "test[:1000]"  # One evaluation at the end.
  return config
