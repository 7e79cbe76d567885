"""The training loop: `Trainer`, its actions, state, optimizer and metric helpers.

The names below are imported on first use, so that `python -m trainer.distributed.launch`
starts processes without loading jax, Flax and TensorFlow itself.

Modules that moved when `trainer/` became packages keep their old import path
(`trainer.optim` is `trainer.step.optim`, `python -m trainer.launch` runs
`trainer.distributed.launch`), with a `FutureWarning` naming the new one.
"""

import time

#: When this program's own work began: `trainer.loop.timing` counts a run's startup from
#: here (a shell that started Python in its own process, `bash -c "pip ... && python ..."`,
#: did its part before).
IMPORTED = time.monotonic()

import importlib  # noqa: E402
import importlib.abc  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

from trainer import _lazy, console  # noqa: E402

console.quiet()  # Before jax or TensorFlow start: their notices are not failures.

_EXPORTS = {
    "Action": "trainer.loop.actions",
    "ClassificationTrainer": "trainer.classification",
    "EmaTrainState": "trainer.step.train_state",
    "FitResult": "trainer.loop.actions",
    "LanguageModelTrainer": "trainer.language_model",
    "NonFiniteError": "trainer.loop.driver",
    "PeriodicCallback": "trainer.loop.actions",
    "PreferenceTrainer": "trainer.preference",
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

#: Names `trainer` exported once and no longer does, and what replaced each.
_REMOVED = {"Loop": "the loop is trainer.loop.driver.run, which Trainer.fit drives "
                    "(trainer.run.Runner)"}

#: Modules that moved, old name -> new; the old name is the same module object.
MOVED_MODULES = {
    "trainer.accumulation": "trainer.step.accumulation",
    "trainer.devices": "trainer.distributed.devices",
    "trainer.feed": "trainer.data.feed",
    "trainer.launch": "trainer.distributed.launch",
    "trainer.model_variables": "trainer.step.model_variables",
    "trainer.optim": "trainer.step.optim",
    "trainer.pipeline": "trainer.data.pipeline",
    "trainer.precision": "trainer.step.precision",
    "trainer.train_state": "trainer.step.train_state",
}
#: Modules whose contents were split: importing one names where each part went.
SPLIT_MODULES = {
    "trainer.actions": "trainer.loop.actions (Action, PeriodicCallback, StepView, Produced, "
                       "FitResult), trainer.loop.builtin (the built-in actions) and "
                       "trainer.loop.driver (the loop, NonFiniteError)",
}

__all__ = sorted(_EXPORTS)


class _MovedModuleLoader(importlib.abc.Loader):
  """Loads an old module name as the module it moved to (one module object for both)."""

  def __init__(self, target: str):
    self.target = target

  def create_module(self, spec):
    warnings.warn(f"{spec.name} moved to {self.target}; import that instead.", FutureWarning,
                  stacklevel=2)
    module = importlib.import_module(self.target)
    self._spec = module.__spec__
    return module

  def exec_module(self, module) -> None:
    module.__spec__ = self._spec  # The import machinery gave it the old name's spec.

  def get_code(self, name: str):
    """For `python -m <old name>`: the new module's code, run as `__main__`."""
    warnings.warn(f"{name} moved to {self.target}: python -m {self.target}", FutureWarning,
                  stacklevel=2)
    return importlib.util.find_spec(self.target).loader.get_code(self.target)


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
  def find_spec(self, name: str, path=None, target=None):
    if name in SPLIT_MODULES:
      raise ImportError(f"{name} was split into {SPLIT_MODULES[name]}; import from those.",
                        name=name)
    if name not in MOVED_MODULES:
      return None
    return importlib.util.spec_from_loader(name, _MovedModuleLoader(MOVED_MODULES[name]))


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
  sys.meta_path.append(_MovedModuleFinder())


__getattr__, __dir__ = _lazy.exports(__name__, _EXPORTS, _REMOVED)
