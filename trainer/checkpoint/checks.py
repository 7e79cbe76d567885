"""The checkpoint store's names on disk and its errors, and the checks it makes: of its
settings (`config.checkpoint`, before a run starts) and of a saved state against the one
it restores into. `trainer.checkpoint.store` re-exports these names.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections

from strategies.tree import keypath_str
from trainer.console import quiet_orbax_info  # noqa: F401  (its home before the console)

PyTree = Any

#: Bumped when the meaning of the on-disk layout changes.
LAYOUT_VERSION = 1
STATE_ITEM = "state"
LAYOUT_ITEM = "layout"
#: What orbax puts in the name of a step directory it is still writing.
TMP_MARK = ".orbax-checkpoint-tmp"


class CheckpointError(RuntimeError):
  """A checkpoint cannot be saved, read, or restored into the requested state."""


class CorruptCheckpointError(CheckpointError):
  """A checkpoint step cannot be read: an unreadable or truncated file, a missing item, no
  commit marker. On resume such a step is set aside (`config.checkpoint.on_corrupt`)."""


#: What `config.checkpoint.on_corrupt` may say a resume does with an unreadable latest step:
#: set it aside and resume from the newest readable one, or raise.
ON_CORRUPT = ("fallback", "error")
#: What `config.checkpoint.on_save_error` may say a run does when a save fails: raise
#: (the run stops), or log it and save again at the next save step.
ON_SAVE_ERROR = ("stop", "continue")
#: The file orbax writes into a step directory once the step is finalized (orbax >= 0.12.3).
COMMIT_MARKER = "commit_success.txt"
#: The suffix of a step directory set aside as unreadable: `<step>.corrupt-<UTC time>`.
SET_ASIDE = ".corrupt-"


def check_compatible(saved: Mapping, target: Mapping, *, step: int, directory: str) -> None:
  """Raises CheckpointError at the first array whose path or shape differs.

  Args:
    saved: the checkpoint's array metadata (objects with `.shape`), as a state dict.
    target: the state dict to restore into (objects with `.shape`).
  """
  saved_leaves = dict((keypath_str(p), x) for p, x in jax.tree_util.tree_leaves_with_path(saved))
  target_leaves = dict((keypath_str(p), x) for p, x in jax.tree_util.tree_leaves_with_path(target))
  where = f"checkpoint step {step} in {directory}"
  # Parameters first: a different model shows there before its optimizer state.
  for path, want in sorted(target_leaves.items(), key=lambda kv: not kv[0].startswith("params")):
    if path not in saved_leaves:
      raise CheckpointError(
          f"{where} has no array {path!r}, which the model being restored needs "
          f"(shape {tuple(want.shape)}); the checkpoint belongs to a different model.")
    have = saved_leaves[path]
    if tuple(have.shape) != tuple(want.shape):
      raise CheckpointError(
          f"{where} does not fit the model: {path!r} has shape {tuple(have.shape)} in the "
          f"checkpoint but {tuple(want.shape)} in the model being restored.")
  extra = sorted(set(saved_leaves) - set(target_leaves))
  if extra:
    raise CheckpointError(
        f"{where} holds {extra[0]!r} (shape {tuple(saved_leaves[extra[0]].shape)}), which "
        f"the model being restored does not have; the checkpoint belongs to a different model.")


def check_settings(*, every_steps: int, max_to_keep: int, best_mode: str,
                   keep_best: int, on_corrupt: str = "fallback",
                   on_save_error: str = "stop") -> None:
  """Raises unless the `config.checkpoint` settings are usable (`Checkpointer`'s arguments).

  Raises:
    ValueError: naming the field, its value and what it accepts.
  """
  if not isinstance(every_steps, int) or every_steps < 0:
    raise ValueError(f"config.checkpoint.every_steps={every_steps!r} must be an integer "
                     f">= 0 (0: save only at the end of training and on SIGTERM).")
  if not isinstance(max_to_keep, int) or max_to_keep < 1:
    raise ValueError(f"config.checkpoint.max_to_keep={max_to_keep!r} must be an integer "
                     f">= 1.")
  if best_mode not in ("max", "min"):
    raise ValueError(f"config.checkpoint.best_mode={best_mode!r} must be 'max' or 'min'.")
  if not isinstance(keep_best, int) or keep_best < 1:
    raise ValueError(f"config.checkpoint.keep_best={keep_best!r} must be an integer >= 1.")
  if on_corrupt not in ON_CORRUPT:
    raise ValueError(f"config.checkpoint.on_corrupt={on_corrupt!r} is not one of {ON_CORRUPT}: "
                     f"'fallback' sets an unreadable latest checkpoint aside on resume and "
                     f"resumes from the newest readable one, 'error' raises.")
  if on_save_error not in ON_SAVE_ERROR:
    raise ValueError(f"config.checkpoint.on_save_error={on_save_error!r} is not one of "
                     f"{ON_SAVE_ERROR}: 'stop' ends the run with the error, 'continue' logs it "
                     f"and saves again at the next save step.")


def check_config(config: ml_collections.ConfigDict) -> None:
  """Raises unless `config.checkpoint` is usable (`check_settings`)."""
  c = config.checkpoint
  check_settings(every_steps=c.every_steps, max_to_keep=c.max_to_keep, best_mode=c.best_mode,
                 keep_best=c.keep_best, on_corrupt=c.on_corrupt, on_save_error=c.on_save_error)


class _FirstWriteFailure(logging.Handler):
  """The first failure orbax's background write threads log for one directory.

  A write that fails (ENOSPC) can make orbax's own clean-up of the step's temporary
  directory fail next, and `save` then raises that second error; the first one, the
  cause, is only logged. The checkpointer names it in its error.
  """

  def __init__(self, directory: str):
    super().__init__(logging.ERROR)
    self.directory, self.message = directory, None

  def emit(self, record: logging.LogRecord) -> None:
    text = record.getMessage()
    if self.message is None and "raised an exception: " in text and self.directory in text:
      self.message = text.split("raised an exception: ", 1)[1]
