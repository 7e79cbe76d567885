"""The flagship: an 8-member MNIST CNN ensemble, one member per device under pmap.

    python examples/mnist_ensemble.py --config=configs/mnist_ensemble.py --workdir=/tmp/mnist

Any registered strategy runs with `--config.strategy.name=...` as the only
change; non-ensemble strategies train one model.
"""

import os

import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  config.trainer = "examples/mnist_ensemble.py:MNISTTrainer"
  config.ensemble_size = 8  # Members; pmap_ensemble needs one device per member.
  # On a CPU-only host the entry point makes this many host devices before jax
  # starts (0: leave jax's default). Ignored on GPU/TPU. A derived reference:
  # it follows ensemble_size (`--config.ensemble_size=16` alone runs 16
  # members), and setting it leaves ensemble_size alone.
  config.num_cpu_devices = config.get_ref("ensemble_size").identity()

  config.batch_size = 128
  config.eval_batch_size = 500  # Any size: the Trainer pads each eval batch to split evenly.
  # One pass: about 4.5 minutes for 8 members on 2 CPU cores, to 98.6% (the ensemble's test
  # accuracy). The Flax MNIST example's 10 (--config.num_epochs=10): 99.4%, half an hour.
  config.num_epochs = 1
  config.num_train_steps = -1  # > 0 overrides num_epochs.
  config.log_every_steps = 100
  config.eval_every_steps = 0  # 0: evaluate at the end only.
  config.checkpoint.every_steps = 468  # One epoch at batch 128.
  config.learning_rate = 0.1
  config.momentum = 0.9

  config.strategy.name = "pmap_ensemble"

  config.model = ml_collections.ConfigDict()
  config.model.name = "cnn"  # "cnn" (models.CNN) or "resnet" (models.ResNet, with BatchNorm).
  config.model.stage_sizes = (1, 1, 1)  # ResNet only: blocks per stage.
  config.model.num_filters = 8  # ResNet only: channels of the first stage (doubling per stage).

  config.data = ml_collections.ConfigDict()
  config.data.name = "mnist"
  # TFDS split strings: a slice such as "train[:10%]" or "test[:1000]" trains or
  # evaluates on part of a split.
  config.data.train_split = "train"
  config.data.eval_split = "test"
  # "grain": streamed by Grain from TFDS array_record files, each process reading its
  # rows (trainer.data.pipeline); "memory": the splits read into host memory (trainer.data);
  # "device": the train split placed on every device once, each step gathering its
  # batch inside the compiled call (trainer.data.device; configs/mnist_on_device.py).
  config.data.pipeline = "grain"
  # Train and evaluate on the examples of these labels only (labels unchanged), e.g.
  # (0, 1, 2, 3, 4); empty: all. The "memory" and "device" pipelines (configs/mnist_finetune.py).
  config.data.classes = ()
  config.data.read_threads = 4  # Grain reader threads decoding records ahead of the loop.
  config.data.prefetch_batches = 8  # Batches the Grain readers keep ready.
  # Directory with the four original IDX .gz files: TFDS then prepares MNIST
  # with no network. Empty: $TFDS_MANUAL_DIR, else TFDS downloads them.
  config.data.manual_dir = os.environ.get("TFDS_MANUAL_DIR", "")
  # Where TFDS keeps prepared datasets. Empty: $TFDS_DATA_DIR or ~/tensorflow_datasets.
  config.data.data_dir = os.environ.get("TFDS_DATA_DIR", "")
  return config
