"""Fine-tuning: a CNN pretrained on digits 0-4, then trained on 5-9 with its convolutions
frozen and a new head, against the same CNN trained from scratch on 5-9.

    python examples/mnist_ensemble.py --config=configs/mnist_finetune.py:pretrain \
        --workdir=/tmp/mnist_pretrain
    python examples/mnist_ensemble.py --config=configs/mnist_finetune.py:finetune \
        --workdir=/tmp/mnist_finetune --config.init_from.path=/tmp/mnist_pretrain
    python examples/mnist_ensemble.py --config=configs/mnist_finetune.py:scratch \
        --workdir=/tmp/mnist_scratch

`finetune` starts from the pretrain run's latest checkpoint (`config.init_from`):
the convolutions and the first dense layer from it, the output layer (`Dense_1`)
freshly initialised; the convolutions then stay frozen (`config.freeze`), so
only the dense layers train, and they carry the only optimizer state.
`scratch` is the same run without either. Both train and evaluate on digits 5-9
only, for the same steps.
"""

import ml_collections

from configs import mnist_ensemble

#: The variant -> (digits, init_from and freeze).
VARIANTS = ("pretrain", "finetune", "scratch")


def get_config(variant: str = "finetune") -> ml_collections.ConfigDict:
  if variant not in VARIANTS:
    raise ValueError(f"configs/mnist_finetune.py:{variant} is not a variant; use one of "
                     f"{VARIANTS}.")
  config = mnist_ensemble.get_config()
  config.strategy.name = "single_device"
  config.ensemble_size = 0
  config.num_cpu_devices = 0
  config.data.pipeline = "memory"
  config.num_epochs = 0
  config.learning_rate = 0.05
  config.checkpoint.every_steps = 0  # At the end only.
  config.log_every_steps = 50
  if variant == "pretrain":
    config.data.classes = (0, 1, 2, 3, 4)
    config.num_train_steps = 600  # About 2.5 epochs of the 30.6k train images of 0-4.
    return config
  config.data.classes = (5, 6, 7, 8, 9)
  # Few steps on the new digits: where a pretrained backbone shows.
  config.num_train_steps = 60
  if variant == "finetune":
    config.init_from.path = "/tmp/mnist_pretrain"  # The pretrain run's workdir.
    config.init_from.fresh = ("Dense_1/.*",)  # A new head.
    config.freeze = ("Conv_.*",)
  return config
