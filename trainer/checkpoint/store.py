"""The checkpoint store: orbax, in one layout that does not depend on the strategy.

On disk a checkpoint step holds two items:

- `state`: the train state as a flax state dict (`params`, `opt_state`,
  `step`, `rng`). Single-model strategies store one copy of every array
  (never one per replica); ensemble strategies store every array with a
  leading member axis. Sharded arrays are written shard by shard, as global
  arrays, without gathering them onto one device.
- `layout`: JSON saying how many members the state holds and which strategy
  wrote it.

Restoring builds the abstract state (shapes, dtypes and the destination
strategy's shardings) and lets orbax place each array directly, so a
checkpoint restores under any strategy that can hold it. Saves are
asynchronous: training continues while a save is written, and a failed save
is raised as `CheckpointError` at the next save or at `wait`.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from flax import serialization

from trainer import console
from trainer.checkpoint.checks import (  # noqa: F401 -- this module's names before the split
  COMMIT_MARKER,
  LAYOUT_ITEM,
  LAYOUT_VERSION,
  ON_CORRUPT,
  ON_SAVE_ERROR,
  SET_ASIDE,
  STATE_ITEM,
  TMP_MARK,
  CheckpointError,
  CorruptCheckpointError,
  _FirstWriteFailure,
  check_compatible,
  check_config,
  check_settings,
  quiet_orbax_info,
)
from trainer.checkpoint.handler import state_handler
from trainer.distributed.agree import any_process
from trainer.step.quantized_base import packed_for_saving, packed_target, unpacked

PyTree = Any


def _on_disk(directory: str) -> bool:
  """Whether this process sees `directory` (its own view of a possibly shared filesystem)."""
  return os.path.isdir(directory)

class Checkpointer:
  """Saves and restores train states in a directory with an orbax `CheckpointManager`.

  Only complete checkpoints count: orbax writes each step into a temporary
  directory and renames it when the write has finished, so a process killed
  mid-save leaves the previous checkpoint as the latest.
  """

  def __init__(self, directory: str | os.PathLike, *, every_steps: int = 1000,
               max_to_keep: int = 3, async_save: bool = True, best_metric: str = "",
               best_mode: str = "max", keep_best: int = 1, on_corrupt: str = "fallback",
               on_save_error: str = "stop"):
    """Checks the settings; reads and deletes nothing, and makes no directory until a save.

    Args:
      directory: where the step directories go.
      every_steps: the periodic save interval (0: only at the end and on a stop).
      max_to_keep: how many of the latest checkpoints are kept (for resuming).
      async_save: write in the background while training continues.
      best_metric: an eval metric; when set, checkpoints saved at an
        evaluation carry its results, and the `keep_best` best by this metric
        are kept beside the latest ones (orbax's `BestN` and `LatestN`
        preservation policies).
      best_mode: 'max' or 'min': which end of `best_metric` is best.
      keep_best: how many best checkpoints to keep.
      on_corrupt: what a resume does with an unreadable latest checkpoint
        (`ON_CORRUPT`): 'fallback' sets it aside (`set_aside`) and resumes from
        the newest readable one; 'error' raises.
      on_save_error: what a failed save does (`ON_SAVE_ERROR`): 'stop' raises
        `CheckpointError`; 'continue' logs it, removes what it left half-written
        and saves again at the next save (a failed last save still raises at `wait`).

    Raises:
      ValueError: `every_steps` is negative, `max_to_keep` or `keep_best` is
        below 1, or `best_mode`, `on_corrupt` or `on_save_error` is not one of its values.
    """
    check_settings(every_steps=every_steps, max_to_keep=max_to_keep, best_mode=best_mode,
                   keep_best=keep_best, on_corrupt=on_corrupt, on_save_error=on_save_error)
    self.on_corrupt, self.on_save_error = on_corrupt, on_save_error
    self.failed_saves: list[int] = []  # Steps whose save failed under 'continue'.
    self.directory = os.path.abspath(os.fspath(directory))
    self.every_steps = every_steps
    self.best_metric, self.best_mode = best_metric, best_mode
    if best_metric:
      def metric(metrics):
        return metrics[best_metric]

      keep = dict(
          best_fn=metric, best_mode=best_mode,
          preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy([
              ocp.checkpoint_managers.LatestN(n=max_to_keep),
              ocp.checkpoint_managers.BestN(get_metric_fn=metric, reverse=best_mode == "min",
                                            n=keep_best, keep_checkpoints_without_metrics=False),
          ]))
    else:
      keep = dict(max_to_keep=max_to_keep)
    if os.path.exists(self.directory) and not os.path.isdir(self.directory):
      raise CheckpointError(f"checkpoint directory {self.directory} exists and is not a "
                            f"directory.")
    # The orbax manager (which makes the directory) is made on first use, so a run
    # that fails its config checks after building the checkpointer leaves no trace.
    self._options = ocp.CheckpointManagerOptions(
        **keep, enable_async_checkpointing=async_save, create=True,
        # Directories are made before save() returns: a directory that cannot be
        # made fails that call, instead of leaving orbax's writer threads waiting.
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        # A save interrupted by a crash leaves a temporary directory: removed on start.
        cleanup_tmp_directories=True)
    self._made: ocp.CheckpointManager | None = None
    self._write_failure = _FirstWriteFailure(str(self.directory))
    self._pending_step: int | None = None  # The step of a save that may still be writing.

  @property
  def _manager(self) -> ocp.CheckpointManager:
    if self._made is None:
      quiet_orbax_info()
      logging.getLogger("absl").addHandler(self._write_failure)
      self._made = ocp.CheckpointManager(
          self.directory, options=self._options,
          item_handlers={STATE_ITEM: state_handler(),
                         LAYOUT_ITEM: ocp.JsonCheckpointHandler()})
    return self._made

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, workdir: str) -> Checkpointer:
    """A checkpointer in `<workdir>/checkpoints` from `config.checkpoint`."""
    return cls(os.path.join(workdir, "checkpoints"),
               every_steps=config.checkpoint.every_steps,
               max_to_keep=config.checkpoint.max_to_keep,
               async_save=config.checkpoint.async_save,
               best_metric=config.checkpoint.best_metric,
               best_mode=config.checkpoint.best_mode,
               keep_best=config.checkpoint.keep_best,
               on_corrupt=config.checkpoint.on_corrupt,
               on_save_error=config.checkpoint.on_save_error)

  # -- Steps -------------------------------------------------------------------

  def all_steps(self) -> list[int]:
    """The steps of complete checkpoints, oldest first.

    Until the first save or read, every process of a run must call it at the same point:
    orbax's manager, made on first use, enters a barrier of all processes, so whether to
    make it is decided from what all of them see (one process may not see the directory
    another has just made).
    """
    if self._made is None and not any_process(_on_disk(self.directory)):
      return []  # Nothing saved yet; the directory is made by the first save.
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The step of the newest complete checkpoint, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def best_step(self) -> int | None:
    """The step of the best checkpoint by `best_metric` (the latest without one), or None."""
    self._manager.reload()
    return self._manager.best_step()

  def remove_partial(self) -> None:
    """Deletes the temporary directories of saves that did not finish (orbax writes a step
    into one and renames it when complete), so that nothing half-written is left."""
    if not os.path.isdir(self.directory):
      return
    for name in os.listdir(self.directory):
      if TMP_MARK in name:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        logging.warning("Removed the unfinished checkpoint save %s",
                        os.path.join(self.directory, name))

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _quiesce(self, timeout: float = 10.0, interval: float = 0.2) -> None:
    """Waits until nothing writes into the temporary directories of a failed save.

    When one item of a save fails, orbax stops waiting for the others, but their
    writer threads go on for a while: a save or a restart in this directory would
    race them when it removes the half-written step (`Directory not empty`).
    """
    def snapshot():
      found = []
      for name in (os.listdir(self.directory) if os.path.isdir(self.directory) else ()):
        if TMP_MARK in name:
          for root, _, files in os.walk(os.path.join(self.directory, name)):
            for f in files:
              try:
                found.append((root, f, os.path.getsize(os.path.join(root, f))))
              except OSError:
                found.append((root, f, -1))
      return sorted(found)

    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
      now = snapshot()
      if now == last:
        return
      last = now
      time.sleep(interval)

  def is_save_step(self, step: int) -> bool:
    """Whether the periodic schedule saves at `step` (the final step always saves)."""
    return bool(self.every_steps) and step % self.every_steps == 0

  # -- Saving ------------------------------------------------------------------

  def save(self, step: int, state: PyTree, layout: Mapping[str, Any], *,
           metrics: Mapping[str, float] | None = None,
           action_states: Mapping[str, Any] | None = None, data_state: Any = None) -> None:
    """Starts writing `state` (canonical layout, device arrays) as checkpoint `step`.

    Returns once the arrays have been copied off the devices; the files are
    written in the background. An earlier save that failed is raised here.

    Args:
      metrics: eval results at `step`; kept (and ranked) only with a `best_metric`.
      action_states: the loop actions' JSON state, stored in the layout item.
      data_state: the train data iterator's JSON state (Grain's `get_state()`).

    Raises:
      ValueError: `metrics` lacks `best_metric`.
      CheckpointError: this save, or the previous one, failed.
    """
    if metrics is not None and self.best_metric:
      if self.best_metric not in metrics:
        raise ValueError(f"config.checkpoint.best_metric={self.best_metric!r} is not an eval "
                         f"metric; the eval metrics are {sorted(metrics)}.")
      metrics = {k: float(v) for k, v in metrics.items()}
    else:
      metrics = None
    self._settle()
    layout = {"version": LAYOUT_VERSION, "step": step, **layout,
              "actions": dict(action_states or {}), "data": data_state}
    try:
      self._manager.save(step, args=ocp.args.Composite(**{
          STATE_ITEM: ocp.args.StandardSave(packed_for_saving(serialization.to_state_dict(state))),
          LAYOUT_ITEM: ocp.args.JsonSave(layout),
      }), metrics=metrics, force=True)
    except Exception as e:
      self._quiesce()
      error = CheckpointError(f"saving checkpoint step {step} to {self.directory} failed: "
                              f"{self._cause(e)}. {self._untouched()}")
      if self.on_save_error == "stop":
        raise error from e
      self._failed(step, error)
      return
    self._pending_step = step

  def _cause(self, error: Exception) -> str:
    """`error`, after the failure of orbax's background write that led to it, if one was
    logged since the last save that landed (`_FirstWriteFailure`)."""
    first = self._write_failure.message
    if first and first not in str(error):
      return f"{first} (then {type(error).__name__}: {error})"
    return f"{type(error).__name__}: {error}"

  def _untouched(self) -> str:
    """Where the run can resume from after a failed save."""
    steps = [s for s in self.all_steps() if s != self._pending_step]
    return (f"The latest complete checkpoint, step {steps[-1]}, is untouched." if steps
            else "No complete checkpoint was written before it.")

  def _settle(self) -> None:
    """Waits for the previous save; under `on_save_error='continue'` a failure is logged."""
    step = self._pending_step
    try:
      self.wait()
    except CheckpointError as e:
      if self.on_save_error == "stop":
        raise
      self._failed(step, e)

  def _failed(self, step: int, error: CheckpointError) -> None:
    self._write_failure.message = None  # Reported: the next failure names its own cause.
    self.failed_saves.append(step)
    self.remove_partial()
    logging.error("%s The run goes on (config.checkpoint.on_save_error='continue') and "
                  "saves again at the next save step.", error)

  def wait(self) -> None:
    """Blocks until the last save is on disk.

    Raises:
      CheckpointError: the last save failed.
    """
    if self._made is None:
      return
    try:
      self._manager.wait_until_finished()
    except Exception as e:
      step = self._pending_step
      self._quiesce()
      error = CheckpointError(f"writing checkpoint step {step} to {self.directory} failed: "
                              f"{self._cause(e)}. {self._untouched()}")
      self._pending_step = None
      raise error from e
    self._pending_step = None
    self._write_failure.message = None  # The saves so far landed.

  def close(self) -> None:
    """Waits for the last save and releases orbax's resources."""
    try:
      self.wait()
    finally:
      if self._made is not None:
        self._made.close()
        logging.getLogger("absl").removeHandler(self._write_failure)

  # -- Reading -----------------------------------------------------------------

  def _read_error(self, step: int, e: Exception) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checkpoint step {step} in {self.step_dir(step)} is unreadable or corrupt "
        f"({type(e).__name__}: {e}). Nothing was deleted: on resume, "
        f"config.checkpoint.on_corrupt='fallback' sets it aside and resumes from the newest "
        f"readable checkpoint; or move the step directory away yourself.")

  def set_aside(self, step: int, reason: Exception) -> str:
    """Renames the unreadable step directory `<step>` to `<step>.corrupt-<UTC time>` (never
    deletes it), so the step before it becomes the latest; returns the new path.

    Every process of a multi-process run calls it; process 0 renames, the others
    wait for it.
    """
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved = f"{self.step_dir(step)}{SET_ASIDE}{stamp}"
    if jax.process_index() == 0:
      os.rename(self.step_dir(step), moved)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
    self._manager.reload()
    cause = reason.__cause__ or reason
    logging.error("Checkpoint step %d is unreadable (%s: %s); set aside as %s, nothing "
                  "deleted (config.checkpoint.on_corrupt='fallback'; the full error with "
                  "--verbosity=1).", step, type(cause).__name__, console.one_line(cause), moved)
    logging.debug("Checkpoint step %d: the full read error: %s", step, reason)
    return moved

  def layout(self, step: int) -> dict[str, Any]:
    """The `layout` item of checkpoint `step`: members, strategy, format version.

    Raises:
      CorruptCheckpointError: the step has no commit marker or no readable layout.
    """
    if not os.path.exists(os.path.join(self.step_dir(step), COMMIT_MARKER)):
      raise self._read_error(step, FileNotFoundError(
          f"no {COMMIT_MARKER}: orbax did not finalize this step"))
    try:
      restored = self._manager.restore(
          step, args=ocp.args.Composite(**{LAYOUT_ITEM: ocp.args.JsonRestore()}))
      layout = dict(restored[LAYOUT_ITEM])
    except Exception as e:
      raise self._read_error(step, e) from e
    if layout.get("version") != LAYOUT_VERSION or "num_members" not in layout:
      raise self._read_error(step, ValueError(f"unknown layout {layout}"))
    return layout

  def data_state(self, step: int) -> Any:
    """The train data iterator's state saved with checkpoint `step` (None if none)."""
    return self.layout(step).get("data")

  def saved_arrays(self, step: int) -> dict[str, Any]:
    """The state dict of checkpoint `step`'s arrays as saved: metadata leaves with `.shape`
    and `.dtype`, nothing read.

    Raises:
      CorruptCheckpointError: the step has no readable state item.
    """
    try:
      saved = self._manager.item_metadata(step)[STATE_ITEM]
      saved = getattr(saved, "tree", saved)
    except Exception as e:
      raise self._read_error(step, e) from e
    if saved is None:
      raise self._read_error(step, FileNotFoundError(f"no {STATE_ITEM!r} item"))
    return saved

  def restore(self, step: int, target: PyTree) -> PyTree:
    """Restores checkpoint `step` into the structure of `target`.

    Args:
      target: a pytree of `jax.ShapeDtypeStruct` leaves carrying the shardings the
        restored arrays must have (its state dict is what is read).

    Raises:
      CheckpointError: the checkpoint is unreadable, or an array's path or
        shape differs from `target`'s.
    """
    target_dict = serialization.to_state_dict(target)
    on_disk = packed_target(target_dict)  # 4-bit codes are stored two per byte.
    saved = self.saved_arrays(step)
    check_compatible(saved, on_disk, step=step, directory=self.step_dir(step))
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**{
          STATE_ITEM: ocp.args.StandardRestore(on_disk)}))[STATE_ITEM]
    except Exception as e:
      raise self._read_error(step, e) from e
    restored = unpacked(restored, target_dict)
    logging.info("Restored checkpoint step %d from %s", step, self.step_dir(step))
    return serialization.from_state_dict(target, restored)
