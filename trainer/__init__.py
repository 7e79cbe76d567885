"""The training loop: `Trainer`, its actions, state, optimizer and metric helpers.

The names below are imported on first use, so that `python -m trainer.distributed.launch`
starts processes without loading jax, Flax and TensorFlow itself.
"""

import importlib

_EXPORTS = {
    "Action": "trainer.loop.actions",
    "ClassificationTrainer": "trainer.classification",
    "EmaTrainState": "trainer.step.train_state",
    "FitResult": "trainer.loop.actions",
    "LanguageModelTrainer": "trainer.language_model",
    "NonFiniteError": "trainer.loop.driver",
    "PeriodicCallback": "trainer.loop.actions",
    "Produced": "trainer.loop.actions",
    "Recipe": "trainer.step.recipe",
    "StepTransform": "trainer.step.recipe",
    "StepView": "trainer.loop.actions",
    "TrainState": "trainer.step.train_state",
    "Trainer": "trainer.trainer",
    "create_optimizer": "trainer.step.optim",
    "create_schedule": "trainer.step.optim",
    "pad_batch": "trainer.evaluation",
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
