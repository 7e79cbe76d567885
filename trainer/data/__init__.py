"""Data: TFDS datasets (`datasets`), the Grain pipeline (`pipeline`), and the device feed
that places train batches ahead of their step (`feed`), and datasets that live on the
devices (`device`).

The names below are `datasets`' public ones, so `from trainer import data` then
`data.prepare(...)` reads as before the package existed.
"""

from trainer import _lazy

_DATASETS = ("FILE_FORMATS", "MANUAL_DIR_ENV", "MANUAL_FILES", "MNIST_FILES", "Split",
             "check_idx_file", "check_reachable", "data_source", "eval_batches", "load_split",
             "num_train_steps", "prepare", "train_batches")
_DEVICE = ("DeviceData", "DeviceSource", "as_float_images")

# Imported on first use: `datasets` imports tensorflow-datasets (half a second, and
# absent where a run reads no TFDS data), so `trainer.data.packing` or `trainer.data.lm`
# alone never loads it.
__getattr__, __dir__ = _lazy.exports(
    __name__, {**{name: "trainer.data.datasets" for name in _DATASETS},
               **{name: "trainer.data.device" for name in _DEVICE}})

__all__ = sorted(_DATASETS + _DEVICE)
