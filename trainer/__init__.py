"""The training loop: `Trainer`, its actions, state, optimizer and metric helpers.

The names below are imported on first use, so that `python -m trainer.launch`
starts processes without loading jax, Flax and TensorFlow itself.
"""

import importlib

_EXPORTS = {
    "Action": "trainer.actions",
    "ClassificationTrainer": "trainer.classification",
    "EmaTrainState": "trainer.train_state",
    "FitResult": "trainer.actions",
    "LanguageModelTrainer": "trainer.language_model",
    "Loop": "trainer.actions",
    "NonFiniteError": "trainer.actions",
    "PeriodicCallback": "trainer.actions",
    "TrainState": "trainer.train_state",
    "Trainer": "trainer.trainer",
    "create_optimizer": "trainer.optim",
    "create_schedule": "trainer.optim",
    "pad_batch": "trainer.trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
  value = getattr(importlib.import_module(_EXPORTS[name]), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(list(globals()) + __all__)
