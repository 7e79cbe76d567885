"""The config, checked before any part is built, and its command-line overrides explained.

Each config default is declared once, in `configs/base.py`. Each part reads
the fields it owns and knows what they accept: the run its loop fields
(`trainer.run.RunOptions`), the recipe its transforms' fields, the optimizer
its own, the checkpointer `checkpoint.*`, the sweep `sweep.*`. `check_config`
asks every part at once, before any of them is built, so a bad value is
refused, naming the field, the value and what is accepted, before a device,
a dataset or a checkpoint is touched. Checks that need another part (a batch
size that must split over the strategy's data replicas, a mesh that must
cover the devices) run when that part is built, still before any compute.

`parse_flags` is absl's flag parsing for an entry point
(`app.run(main, flags_parser=parse_flags)`), with an override of a field the
config does not have (`--config.sweep.grid.dropout_rate=...`) refused by
naming the field and what the config has there, instead of ml_collections'
bare `AttributeError`.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import ml_collections


def check_config(config: ml_collections.ConfigDict, *,
                 num_train_steps: int | None = None) -> None:
  """Raises for the first field whose value its part does not accept.

  Args:
    config: the run's config (`configs/base.py`'s fields, and the setup's).
    num_train_steps: the run's length, which a decaying schedule needs.

  Raises:
    ValueError: naming the field, its value and what is accepted.
  """
  from trainer import writers
  from trainer.checkpoint import store
  from trainer.loop import builtin
  from trainer.run.options import RunOptions
  from trainer.step import accumulation, functions, optim, recipe
  from trainer.step.precision import Precision
  from trainer.step.remat import Remat
  from trainer.sweep.members import Sweep

  RunOptions.from_config(config)
  functions.check_steps_loop(config.steps_loop)
  sweep = Sweep.from_config(config)
  optim.check_config(config, num_train_steps, swept=sweep is not None)
  Precision.from_config(config)
  accumulation.check_loop(config.grad_accum_loop)
  recipe.check_config(config)
  Remat.from_config(config)
  store.check_config(config)
  builtin.check_config(config)
  writers.check_writers(config.writers)
  if not isinstance(config.eval_batch_size, int) or config.eval_batch_size < 1:
    raise ValueError(f"config.eval_batch_size={config.eval_batch_size!r} must be a positive "
                     f"integer (any size: eval batches are padded to split evenly).")


class OverrideError(ValueError):
  """A command-line override names a field the config does not have."""


def unknown_override(config: ml_collections.ConfigDict, argv: Sequence[str],
                     flag: str = "config") -> OverrideError | None:
  """The error for the first `--config.<path>=...` in `argv` whose path `config` lacks.

  Under `sweep.grid` it names the fields a sweep can vary, and what to do for a
  module hyperparameter; elsewhere, what the config has at that level and the
  nearest names.
  """
  prefix = f"--{flag}."
  for arg in argv:
    if not arg.startswith(prefix):
      continue
    path = arg[len(prefix):].split("=", 1)[0]
    node, parts = config, path.split(".")
    for depth, part in enumerate(parts):
      if isinstance(node, ml_collections.ConfigDict) and part in node:
        node = node[part]
        continue
      parent = ".".join([flag, *parts[:depth]])
      if ".".join(parts[:depth]) == "sweep.grid":
        from trainer.sweep.members import NOT_SWEPT, SWEPT
        return OverrideError(
            f"{prefix}{path}: {part!r} cannot be swept; the names a sweep can vary are "
            f"{sorted(SWEPT)}: {NOT_SWEPT}.")
      if not isinstance(node, ml_collections.ConfigDict):
        return OverrideError(f"{prefix}{path}: {parent} is a value, not a section with "
                             f"fields.")
      near = difflib.get_close_matches(part, list(node), n=3)
      return OverrideError(
          f"{prefix}{path}: {parent} has no field {part!r}"
          f"{f' (did you mean {near}?)' if near else ''}; its fields are {sorted(node)}. "
          f"Every field and its default is declared in configs/base.py (and the setup's "
          f"config file); an override can only set one of them.")
  return None


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with an override of a missing config field explained.

  Use as `absl.app.run(main, flags_parser=parse_flags)`: a bad override then
  ends the program with `FATAL Flags parsing error: ...` naming the field.
  """
  from absl import flags
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError) as e:  # ml_collections: an override of a missing field.
    try:
      config = flags.FLAGS["config"].value
    except KeyError:
      raise e from None
    error = unknown_override(config, argv) if config is not None else None
    if error is None:
      raise
    raise flags.IllegalFlagValueError(str(error)) from e
