"""Data: TFDS datasets (`datasets`), the Grain pipeline (`pipeline`), and the device feed
that places train batches ahead of their step (`feed`), and datasets that live on the
devices (`device`).

The names below are `datasets`' public ones, so `from trainer import data` then
`data.prepare(...)` reads as before the package existed.
"""

from trainer.data.datasets import (
  FILE_FORMATS,
  MANUAL_DIR_ENV,
  MANUAL_FILES,
  MNIST_FILES,
  Split,
  check_idx_file,
  check_reachable,
  data_source,
  eval_batches,
  load_split,
  num_train_steps,
  prepare,
  train_batches,
)
from trainer.data.device import DeviceData, DeviceSource, as_float_images

__all__ = ["FILE_FORMATS", "MANUAL_DIR_ENV", "MANUAL_FILES", "MNIST_FILES", "DeviceData",
           "DeviceSource", "Split", "as_float_images", "check_idx_file", "check_reachable",
           "data_source", "eval_batches", "load_split", "num_train_steps", "prepare",
           "train_batches"]
