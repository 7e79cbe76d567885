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

`parse_flags` is absl's flag parsing for an entry point, with an override of a field the
config does not have (`--config.sweep.grid.dropout_rate=...`) refused by
naming the field and what the config has there, instead of ml_collections'
bare `AttributeError`. `run(main)` is `absl.app.run` with it, where a refusal (bad input,
a run that cannot go on: `is_refusal`) prints its message alone and exits with status 1;
`--verbosity=1` shows its traceback.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable, Sequence

import ml_collections


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises for the first field whose value its part does not accept.

  Args:
    config: the run's config (`configs/base.py`'s fields, and the setup's).

  Raises:
    ValueError: naming the field, its value and what is accepted.
  """
  from models.attention import Method as AttentionMethod
  from trainer import writers
  from trainer.checkpoint import store
  from trainer.loop import builtin
  from trainer.run.options import RunOptions
  from trainer.step import accumulation, functions, optim, recipe
  from trainer.step.precision import Precision
  from trainer.step.remat import Remat
  from trainer.sweep import lr_find, schedulers, study
  from trainer.sweep.members import Sweep

  RunOptions.from_config(config)
  functions.check_steps_loop(config.steps_loop)
  study.check_config(config)  # Before the sweep reads the study's space.
  sweep = Sweep.from_config(config)
  schedulers.check_config(config, sweep)
  lr_find.check_config(config, sweep)
  optim.check_config(config, swept=sweep is not None)
  Precision.from_config(config)
  accumulation.check_loop(config.grad_accum_loop)
  recipe.check_config(config)
  Remat.from_config(config)
  AttentionMethod.from_config(config)
  store.check_config(config)
  builtin.check_config(config)
  writers.check_writers(config.writers)
  _check_model_against_checkpoint(config)
  if "data" in config and "sources" in config.data and config.data.sources:
    from trainer.data import lm
    lm.check_config(config)  # The corpus's files exist, its fields are accepted.
  if "data" in config and "member_sources" in config.data and config.data.member_sources:
    from trainer.data import lm, members
    if config.strategy.name != "sharded_ensemble":
      raise ValueError(f"config.data.member_sources gives each member its own data, which "
                       f"'sharded_ensemble' places with the member; config.strategy.name="
                       f"{config.strategy.name!r} gives every model the same batch.")
    for i in range(len(members.member_sources(config))):
      lm.check_config(members.member_config(config, i))  # Member i's files exist.
  if not isinstance(config.eval_batch_size, int) or config.eval_batch_size < 1:
    raise ValueError(f"config.eval_batch_size={config.eval_batch_size!r} must be a positive "
                     f"integer (any size: eval batches are padded to split evenly).")


def _check_model_against_checkpoint(config: ml_collections.ConfigDict) -> None:
  """A language model's `config.model` against the Hugging Face checkpoint it starts from
  (`config.init_from.path`), field by field (`trainer.interop.hf.check_model_config`)."""
  path = config.init_from.path
  if not path or "model" not in config or not isinstance(config.model, ml_collections.ConfigDict) \
      or "family" not in config.model:
    return
  model = config.model
  import os

  from trainer.interop import hf
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.exists(path) and hf.is_hf_checkpoint(path):
    hf.check_model_config(model.to_dict(), path)


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
      if ".".join(parts[:depth]) in ("sweep.grid", "sweep.study.space"):
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


def define_config_file(default: str, help_string: str, *, name: str = "config"):
  """`ml_collections.config_flags.DEFINE_config_file(name, default, lock_config=True)` for
  an entry point, with an override of a field the config lacks refused by naming it.

  ml_collections applies the command line's overrides to the default config while the
  flag is defined (without `--config`), so that is where such an override fails too.
  Use with `parse_flags`, which covers an explicit `--config`.
  """
  import sys

  from ml_collections import config_flags
  try:
    return config_flags.DEFINE_config_file(name, default, help_string, lock_config=True)
  except (AttributeError, KeyError, TypeError):
    error = unknown_override(load_config_file(default), sys.argv, name)
    if error is None:
      raise
    raise SystemExit(f"FATAL Flags parsing error: {error}") from None


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (`absl.app.parse_flags_with_usage`), with an override of a field
  the config lacks refused by naming it.

  Use as `absl.app.run(main, flags_parser=parse_flags)`: such an override then ends
  the program with `FATAL Flags parsing error: ...` and status 1, as absl's own
  flag errors do.
  """
  from absl import app
  try:
    return app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError, TypeError):  # ml_collections, on a field it lacks.
    error = unknown_override(_config_file(argv), argv)
    if error is None:
      raise
    raise SystemExit(f"FATAL Flags parsing error: {error}") from None


def _config_file(argv: Sequence[str], flag: str = "config") -> ml_collections.ConfigDict:
  """The config `--config` names in `argv` (else the flag's default), loaded again: absl
  had not stored it when an override failed."""
  from absl import flags
  path = flags.FLAGS[flag].default
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{flag}="):
      path = arg.split("=", 1)[1]
    elif arg == f"--{flag}" and i + 1 < len(argv):
      path = argv[i + 1]
  return load_config_file(path)


def load_config_file(path: str) -> ml_collections.ConfigDict:
  """`get_config()` of a config file, or `get_config(arg)` for `path:arg`, as
  `config_flags` loads it."""
  import importlib.util
  file, _, arg = path.partition(":")
  spec = importlib.util.spec_from_file_location("_checked_config_file", file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


#: Refusals beyond `ValueError` and `OSError`: `(module, class name)`, looked up only where
#: that module is loaded (an exception of its class cannot exist otherwise).
_REFUSALS = (("trainer.checkpoint.checks", "CheckpointError"),
             ("trainer.run.lock", "WorkdirInUseError"),
             ("trainer.loop.driver", "NonFiniteError"))


def is_refusal(error: BaseException) -> bool:
  """Whether `error` says what to change rather than where the code broke: bad input
  (`ValueError`, and its kinds: a config field, a corpus record, a reward's return), a file
  that cannot be read or written (`OSError`), an unreadable checkpoint, a workdir another run
  holds, a run stopped by a non-finite loss."""
  if isinstance(error, ValueError | OSError):
    return True
  for module, name in _REFUSALS:
    loaded = sys.modules.get(module)
    if loaded is not None and isinstance(error, getattr(loaded, name)):
      return True
  return False


def _program() -> str:
  """The command's name: a module run with `-m` (`trainer.export`), else the script's."""
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)
  return spec.name if spec is not None and spec.name else os.path.basename(sys.argv[0])


def run(main: Callable[[list[str]], None], *,
        flags_parser: Callable[[list[str]], list[str]] | None = parse_flags) -> None:
  """`absl.app.run(main)` (with `flags_parser`; None: absl's own), where a refusal
  (`is_refusal`) ends the program with its message alone, `<program>: <message>`, and
  status 1, instead of a traceback; with `--verbosity=1` (or more) the traceback shows."""
  from absl import app, flags

  def guarded(argv):
    try:
      return main(argv)
    except Exception as e:
      if not is_refusal(e) or flags.FLAGS["verbosity"].value >= 1:
        raise
      sys.exit(f"{_program()}: {e}")

  if flags_parser is None:
    app.run(guarded)
  else:
    app.run(guarded, flags_parser=flags_parser)
